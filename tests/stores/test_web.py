"""The web dashboard's WSGI app, called directly (no server) against real SQLite, PostgreSQL and
Redis stores: every page renders, user data is escaped, a dashboard without a token is read-only,
every refused action changes nothing, and a permitted one happens and is recorded in history.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode
from wsgiref.util import setup_testing_defaults

import pytest

from lease_celery import EffectState, GroupLimit, Lease, LeaseState, LimitRefused, Store, open_store
from lease_celery.errors import ConfigError, EffectOutcomeUnknown
from lease_celery.stores.urls import redact
from lease_celery.web import WebApp, make_app
from lease_celery.web.serve import is_loopback
from tests.conftest import fresh_store_url
from tests.support.policy_helpers import CELERY, cli_env, run_cli
from tests.support.queues import own_queue, published, publishing_app
from tests.support.tokens import token_base

TOKEN = "operator-token-0123456789"
EVIL_KEY = "report:<script>alert('key')</script>/a?b=1&c#d \"q\""
EVIL_REASON = "<script>alert('reason')</script> & <b>bold</b>"
EVIL_GROUP = "tenant:<img src=x>"
EFFECT = "publish:<script>alert('effect')</script>:v1"


@dataclass
class Reply:
    status: int
    headers: list[tuple[str, str]]
    text: str

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    def csrf(self) -> str:
        match = re.search(r'name="csrf" value="([0-9a-f]{64})"', self.text)
        assert match is not None, "the page has no form"
        return match.group(1)


class Client:
    """Calls the WSGI app like a browser would: keeps the session cookie it is given."""

    def __init__(self, app: WebApp, *, script_name: str = "", host: str = "127.0.0.1:8765"):
        self.app, self.script_name, self.host = app, script_name, host
        self.cookie: str | None = None

    def request(self, method: str, path: str, query: dict[str, str] | None = None,
                form: dict[str, str] | None = None, headers: dict[str, str] | None = None,
                ) -> Reply:
        environ: dict[str, Any] = {}
        setup_testing_defaults(environ)
        body = urlencode(form or {}).encode()
        environ.update({
            "REQUEST_METHOD": method, "SCRIPT_NAME": self.script_name, "PATH_INFO": path,
            "QUERY_STRING": urlencode(query or {}, quote_via=quote), "HTTP_HOST": self.host,
            "REMOTE_ADDR": "127.0.0.1", "wsgi.input": io.BytesIO(body),
            "CONTENT_LENGTH": str(len(body))})
        if form is not None:
            environ["CONTENT_TYPE"] = "application/x-www-form-urlencoded"
        if self.cookie:
            environ["HTTP_COOKIE"] = self.cookie
        environ.update(headers or {})
        seen: dict[str, Any] = {}

        def start_response(status: str, response_headers: list[tuple[str, str]]) -> None:
            seen["status"], seen["headers"] = int(status.split()[0]), response_headers

        text = b"".join(self.app(environ, start_response)).decode("utf-8")
        reply = Reply(seen["status"], seen["headers"], text)
        cookie = reply.header("Set-Cookie")
        if cookie:
            self.cookie = cookie.split(";", 1)[0]
        return reply

    def get(self, path: str, **query: str) -> Reply:
        return self.request("GET", path, query)

    def post(self, path: str, key: str, form: dict[str, str], **kw: Any) -> Reply:
        return self.request("POST", path, {"key": key}, form, **kw)


@pytest.fixture(params=["sqlite", "postgres", "redis"])
def web_store_url(request: pytest.FixtureRequest) -> str:
    return fresh_store_url(request, request.param)


@pytest.fixture
def store(web_store_url: str) -> Iterator[Store]:
    with open_store(web_store_url) as opened:
        yield opened


@pytest.fixture
def app(web_store_url: str) -> Iterator[WebApp]:
    web = make_app(web_store_url, token=TOKEN)
    yield web
    web.close()


def _populate(store: Store) -> None:
    """A running lease that was taken over (with a stale refusal), a dead key with an evil key
    and reason, and an evil receipt of that key awaiting reconciliation. The store records the
    claims, the takeover and the death itself; the stale refusal is
    lease_celery.runtime.history's."""
    first = store.claim("run:1", owner="w1:1:aa/1", ttl=0.05)
    assert first is not None
    while store.claim("run:1", owner="w2:2:bb/1", ttl=600) is None:
        pass
    store.record_history("run:1", "stale_refused", owner=first.owner, token=first.token,
                         detail="late finish <img src=x onerror=alert(1)>")
    lease = store.claim(EVIL_KEY, owner="w1:1:aa/2", ttl=600)
    assert lease is not None

    def unknown(key: str) -> None:
        raise EffectOutcomeUnknown("the connection dropped after sending")

    with pytest.raises(EffectOutcomeUnknown):
        store.effects.once(EFFECT, {"report": "<script>"}, unknown, lease=lease)
    assert store.kill(lease, reason=EVIL_REASON)
    # A limit group named like a tag, one slot held and one delivery waiting.
    group = GroupLimit(EVIL_GROUP, limit=1)
    assert isinstance(store.claim_limited("lim:1", owner="w1:1:aa/3", ttl=600, limit=group),
                      Lease)
    assert isinstance(store.claim_limited("lim:2", owner="w1:1:aa/4", ttl=600, limit=group,
                                          task={"task": "t", "args": []}), LimitRefused)


def _operator_events(store: Store, key: str) -> list[str]:
    return [e.event for e in store.history(key) if e.event.startswith("operator:")]


def test_every_page_renders_with_its_data(store: Store, app: WebApp) -> None:
    """Overview, running, takeovers and refusals, dead, reconciliation, receipt, key and
    lookup pages answer 200 with their rows; lists reload every 5 s, form pages do not; every
    response carries the CSP and the other security headers; unknown things are 404."""
    _populate(store)
    client = Client(app)
    overview = client.get("/")
    assert overview.status == 200
    assert "run:1" in overview.text and "w2:2:bb/1" in overview.text
    assert "&lt;script&gt;alert(&#x27;key&#x27;)" in overview.text
    assert '<meta http-equiv="refresh" content="5">' in overview.text
    csp = overview.header("Content-Security-Policy")
    assert csp is not None and "default-src 'self'" in csp and "script-src 'none'" in csp
    assert overview.header("X-Frame-Options") == "DENY"
    assert overview.header("Referrer-Policy") == "same-origin"
    running = client.get("/running")
    assert running.status == 200 and "w2:2:bb/1" in running.text and "tries" in running.text
    events = client.get("/events")
    assert events.status == 200
    assert "taken_over" in events.text and "stale_refused" in events.text
    dead = client.get("/dead")
    assert dead.status == 200 and "&lt;b&gt;bold&lt;/b&gt;" in dead.text
    queue = client.get("/reconcile")
    assert queue.status == 200
    limits = client.get("/limits")
    assert limits.status == 200 and "Key-group limits" in limits.text
    assert "&lt;img src=x&gt;" in limits.text and ">1</td><td>–</td><td>1</td>" in limits.text
    assert "Limit groups" in overview.text
    receipt = store.effects.get(EFFECT)
    assert receipt is not None and receipt.fingerprint[:16] in queue.text
    detail = client.get("/receipt", key=EFFECT)
    assert detail.status == 200 and receipt.fingerprint in detail.text
    assert 'id="resolve"' in detail.text and 'id="discard"' in detail.text
    assert 'id="requeue"' in detail.text and "http-equiv" not in detail.text
    page = client.get("/key", key=EVIL_KEY)
    assert page.status == 200 and "<svg" in page.text and "Checkpoint" in page.text
    assert 'id="requeue"' in page.text and "http-equiv" not in page.text
    current = f"token {token_base(store) + 2} (current)"
    assert client.get("/key", key="run:1").text.count(current) == 1
    assert 'name="key"' in client.get("/key").text
    css = client.get("/static/dashboard.css")
    assert css.status == 200 and (css.header("Content-Type") or "").startswith("text/css")
    assert [k for k, _ in css.headers].count("Cache-Control") == 1
    assert client.get("/nope").status == 404
    assert client.get("/key", key="missing").status == 404
    assert client.get("/receipt", key="missing").status == 404
    assert client.get("/receipt").status == 400


def test_lease_celerys_own_rows_are_named_for_what_they_are(store: Store, app: WebApp) -> None:
    """A row lease_celery keeps for itself (the answer to a duplicate, ``KEY#answer:ID``; a
    direct call, ``direct:UUID``) is never shown as if it were a user's key: wherever the
    dashboard lists or shows one, a note says what it is."""
    answer = store.claim("notify:1#answer:0f1e", owner="w1:1:aa/1", ttl=600)
    direct = store.claim("direct:9c2b", owner="w1:1:aa/2", ttl=600)
    assert answer is not None and direct is not None
    client = Client(app)
    running = client.get("/running")
    assert running.status == 200
    assert "answer to a duplicate" in running.text and "direct call" in running.text
    assert "answer to a duplicate" in client.get("/key", key="notify:1#answer:0f1e").text
    assert "direct call" in client.get("/key", key="direct:9c2b").text


def test_keys_reasons_and_details_are_escaped_everywhere(store: Store, app: WebApp) -> None:
    """A key, reason, effect key and history detail holding ``<script>`` and quotes appear as
    text on every page (never as a tag or broken attribute), and links carry the key
    percent-encoded."""
    _populate(store)
    client = Client(app)
    for path, query in [("/", {}), ("/dead", {}), ("/reconcile", {}), ("/events", {}),
                        ("/limits", {}),
                        ("/key", {"key": EVIL_KEY}), ("/key", {"key": "run:1"}),
                        ("/receipt", {"key": EFFECT})]:
        reply = client.request("GET", path, query)
        assert reply.status == 200, (path, reply.text)
        lowered = reply.text.lower()
        assert "<script" not in lowered and "<img" not in lowered and "<b>bold" not in lowered
    page = client.get("/key", key=EVIL_KEY).text
    assert "&lt;script&gt;alert(&#x27;reason&#x27;)&lt;/script&gt; &amp; &lt;b&gt;" in page
    dead = client.get("/dead").text
    assert f'href="/key?key={quote(EVIL_KEY, safe="")}"'.replace("&", "&amp;") in dead
    assert "%3Cscript%3E" in dead and "%2F" in dead and "%23" in dead
    timeline = page[page.index("<svg"):page.index("</svg>")]
    assert "<script" not in timeline.lower()


def test_without_a_token_the_dashboard_is_read_only(store: Store,
                                                    web_store_url: str) -> None:
    """No token: pages render with no form and no session cookie, say they are read-only,
    and every action is refused (403) without changing anything."""
    _populate(store)
    web = make_app(web_store_url)
    try:
        client = Client(web)
        for path, query in [("/", {}), ("/receipt", {"key": EFFECT}),
                            ("/key", {"key": EVIL_KEY})]:
            reply = client.request("GET", path, query)
            assert reply.status == 200 and "<form method=\"post\"" not in reply.text
            assert "read-only" in reply.text and reply.header("Set-Cookie") is None
        for path, key in [("/resolve", EFFECT), ("/discard", EFFECT), ("/requeue", EVIL_KEY)]:
            refused = client.post(path, key, {"token": TOKEN, "csrf": "0" * 64, "result": "1"})
            assert refused.status == 403 and "read-only" in refused.text
    finally:
        web.close()
    receipt = store.effects.get(EFFECT)
    record = store.get(EVIL_KEY)
    assert receipt is not None and receipt.state is EffectState.NEEDS_RECONCILIATION
    assert record is not None and record.state is LeaseState.DEAD
    assert _operator_events(store, EVIL_KEY) == []


def test_refused_actions_change_nothing(store: Store, app: WebApp) -> None:
    """An action without the token, with a wrong one, without or with a foreign CSRF token,
    without the session cookie, from another origin, or as a GET is refused (403/405) with a
    message, and the receipt, the lease and the history are as they were."""
    _populate(store)
    client = Client(app)
    csrf = client.get("/receipt", key=EFFECT).csrf()
    other = Client(app)
    foreign_csrf = other.get("/receipt", key=EFFECT).csrf()
    assert foreign_csrf != csrf
    attempts: list[tuple[dict[str, str], dict[str, str], int, str]] = [
        ({"csrf": csrf, "result": "1"}, {}, 403, "operator token is missing or wrong"),
        ({"csrf": csrf, "token": TOKEN + "x", "result": "1"}, {}, 403, "missing or wrong"),
        ({"csrf": csrf, "token": "", "result": "1"}, {}, 403, "missing or wrong"),
        ({"token": TOKEN, "result": "1"}, {}, 403, "CSRF token is missing"),
        ({"csrf": foreign_csrf, "token": TOKEN, "result": "1"}, {}, 403, "CSRF"),
        ({"csrf": csrf, "token": TOKEN}, {"HTTP_ORIGIN": "http://evil.example"}, 403,
         "evil.example"),
        ({"csrf": csrf, "token": TOKEN}, {"HTTP_ORIGIN": "null"}, 403, "null"),
        ({"csrf": csrf, "token": TOKEN}, {"HTTP_SEC_FETCH_SITE": "cross-site"}, 403,
         "Cross-site"),
    ]
    actions = [("/resolve", EFFECT), ("/discard", EFFECT), ("/requeue", EVIL_KEY)]
    for n, (action, key) in enumerate(actions):
        # A client address per action: three wrong tokens each stay below the guess limit.
        address = {"REMOTE_ADDR": f"10.0.0.{n + 1}"}
        for form, headers, status, message in attempts:
            reply = client.post(action, key, form, headers={**headers, **address})
            assert (reply.status, message in reply.text) == (status, True), (action, form)
            assert "nothing was changed" in reply.text
        cookieless = Client(app)
        reply = cookieless.post(action, key, {"csrf": csrf, "token": TOKEN})
        assert reply.status == 403 and "CSRF" in reply.text
        as_get = client.request("GET", action, {"key": key, "token": TOKEN, "csrf": csrf})
        assert as_get.status == 405 and as_get.header("Allow") == "POST"
    receipt = store.effects.get(EFFECT)
    record = store.get(EVIL_KEY)
    assert receipt is not None and receipt.state is EffectState.NEEDS_RECONCILIATION
    assert record is not None and record.state is LeaseState.DEAD
    assert _operator_events(store, EVIL_KEY) == [] and _operator_events(store, EFFECT) == []


def test_resolve_then_requeue_happen_and_are_recorded(store: Store, app: WebApp) -> None:
    """With the token and the page's CSRF token, resolve records the result (JSON, or the text
    as a string) and requeue makes the dead key ready; each is recorded in the lease key's
    history as ``operator:…`` naming ``web 127.0.0.1``. A second resolve is refused (409)."""
    _populate(store)
    client = Client(app)
    csrf = client.get("/receipt", key=EFFECT).csrf()
    done = client.post("/resolve", EFFECT, {"csrf": csrf, "token": TOKEN,
                                            "result": '{"message_id": "<m1>"}'})
    assert done.status == 200 and "Resolved" in done.text and "&lt;m1&gt;" in done.text
    receipt = store.effects.get(EFFECT)
    assert receipt is not None and receipt.state is EffectState.DONE
    assert receipt.result == {"message_id": "<m1>"}
    again = client.post("/resolve", EFFECT, {"csrf": csrf, "token": TOKEN, "result": "2"})
    assert again.status == 409 and store.effects.get(EFFECT).result == {  # type: ignore[union-attr]
        "message_id": "<m1>"}
    requeued = client.post("/requeue", EVIL_KEY, {"csrf": csrf, "token": TOKEN,
                                                  "reason": "after <reconciliation>"})
    assert requeued.status == 200 and "Requeued" in requeued.text
    record = store.get(EVIL_KEY)
    assert record is not None and record.state is LeaseState.READY
    assert record.reason == "after <reconciliation>"
    entries = [e for e in store.history(EVIL_KEY) if e.event.startswith("operator:")]
    assert [e.event for e in entries] == ["operator:resolve", "operator:requeue"]
    assert all(e.detail is not None and e.detail.startswith("web 127.0.0.1: ")
               for e in entries)
    assert '{"message_id":"<m1>"}' in (entries[0].detail or "")
    assert "after <reconciliation>" in (entries[1].detail or "")
    assert client.post("/requeue", EVIL_KEY, {"csrf": csrf, "token": TOKEN}).status == 409
    page = client.get("/key", key=EVIL_KEY).text
    assert "operator:resolve" in page and "operator:requeue" in page


def test_discard_forgets_the_receipt_and_plain_text_results_are_strings(
        store: Store, app: WebApp) -> None:
    """Discard removes the receipt (recorded as ``operator:discard``); a result that is not
    JSON is stored as the text itself."""
    _populate(store)
    client = Client(app)
    csrf = client.get("/receipt", key=EFFECT).csrf()
    gone = client.post("/discard", EFFECT, {"csrf": csrf, "token": TOKEN})
    assert gone.status == 200 and "Discarded" in gone.text
    assert store.effects.get(EFFECT) is None
    assert _operator_events(store, EVIL_KEY) == ["operator:discard"]
    assert client.post("/discard", EFFECT, {"csrf": csrf, "token": TOKEN}).status == 404
    lease = store.claim("other", owner="w", ttl=600)
    assert lease is not None

    def unknown(key: str) -> None:
        raise EffectOutcomeUnknown("?")

    with pytest.raises(EffectOutcomeUnknown):
        store.effects.once("mail:1", {"to": "x"}, unknown, lease=lease)
    reply = client.post("/resolve", "mail:1", {"csrf": csrf, "token": TOKEN,
                                               "result": "sent by hand"})
    assert reply.status == 200
    assert store.effects.get("mail:1").result == "sent by hand"  # type: ignore[union-attr]


def test_requeue_with_an_app_republishes_the_recorded_task(store: Store,
                                                           web_store_url: str) -> None:
    """Given the Celery app (``leases -A proj web``), requeue re-publishes the task the row
    recorded, with its retry count restarted, and says so in the page and the history."""
    lease = store.claim("job:9", owner="w", ttl=600,
                        task={"task": "jobs.run", "args": [9], "kwargs": {},
                              "options": {"task_id": "task-id-7"}})
    assert lease is not None and store.kill(lease, reason="gave up")
    with own_queue() as queue:
        web = WebApp(open_store(web_store_url), token=TOKEN, app=publishing_app(queue))
        try:
            client = Client(web)
            csrf = client.get("/key", key="job:9").csrf()
            reply = client.post("/requeue", "job:9", {"csrf": csrf, "token": TOKEN})
        finally:
            web.close()
        assert reply.status == 200 and "task task-id-7 published" in reply.text
        assert [(m["task"], m["id"], m["args"], m["retries"]) for m in published(queue)] == [
            ("jobs.run", "task-id-7", [9], 0)]
    record = store.get("job:9")
    assert record is not None and record.state is LeaseState.READY
    (entry,) = [e for e in store.history("job:9") if e.event == "operator:requeue"]
    assert "task task-id-7 published" in (entry.detail or "")


def test_mounted_under_a_prefix_and_host_checks(web_store_url: str) -> None:
    """Mounted at ``/ops/leases`` (SCRIPT_NAME), links, the stylesheet and the cookie path
    carry the prefix; with ``allowed_hosts`` another Host header is refused (400)."""
    web = make_app(web_store_url, token=TOKEN, allowed_hosts=["127.0.0.1", "localhost"])
    try:
        client = Client(web, script_name="/ops/leases", host="localhost:9000")
        page = client.get("/")
        assert page.status == 200 and 'href="/ops/leases/dead"' in page.text
        assert 'href="/ops/leases/static/dashboard.css"' in page.text
        assert "Path=/ops/leases;" in (page.header("Set-Cookie") or "")
        assert Client(web, host="[::1]:80").get("/").status == 400
        rebound = Client(web, host="attacker.example:8765").get("/")
        assert rebound.status == 400 and "attacker" not in rebound.text
    finally:
        web.close()


def test_configuration_checks() -> None:
    """An empty token is refused; the store URL shown loses its password and query; loopback
    is 127.0.0.0/8, ::1 and localhost only."""
    with pytest.raises(ConfigError):
        make_app("sqlite://", token=" ")
    assert redact("postgresql://u:secret@db:5432/x?password=p") == "postgresql://u:***@db:5432/x"
    assert all(map(is_loopback, ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "example.com", ""]))


def test_cli_refuses_a_non_loopback_host_without_a_token(sqlite_url: str,
                                                         tmp_path: Path) -> None:
    """``celery -A proj leases web --host 0.0.0.0`` without ``--token`` is a usage error
    (exit 2) saying why, and nothing listens."""
    proc = run_cli(["web", "--host", "0.0.0.0", "--port", "0"], env=cli_env(sqlite_url),
                   cwd=tmp_path, program=CELERY)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "not a loopback address" in proc.stderr and "--token" in proc.stderr


# -- hostile input (issue 20: the dashboard on a network) --------------------------------------


@pytest.fixture
def sqlite_app(sqlite_url: str) -> Iterator[tuple[Store, WebApp]]:
    with open_store(sqlite_url) as opened:
        web = make_app(sqlite_url, token=TOKEN)
        yield opened, web
        web.close()


def test_a_script_name_that_names_a_host_keeps_every_link_on_the_site(
        sqlite_app: tuple[Store, WebApp]) -> None:
    """A SCRIPT_NAME of ``//evil.example`` (a proxy's or a mount's) is taken as the path
    ``/evil.example``: no link, form or cookie path of the page leaves the site."""
    store, app = sqlite_app
    lease = store.claim("job:1", owner="w", ttl=60)
    assert lease is not None and store.kill(lease, reason="boom")
    for path, query in [("/", {}), ("/dead", {}), ("/key", {"key": "job:1"})]:
        reply = Client(app, script_name="//evil.example").get(path, **query)
        assert reply.status == 200, reply.text
        targets = re.findall(r'(?:href|action)="([^"]*)"', reply.text)
        assert targets and all(t.startswith("/evil.example/") or t == "/evil.example"
                               for t in targets), targets
        assert not any(t.startswith("//") for t in targets)
        cookie = reply.header("Set-Cookie") or ""
        assert "Path=//" not in cookie, cookie


def test_bidi_and_zero_width_characters_of_a_key_are_shown_escaped(
        sqlite_app: tuple[Store, WebApp]) -> None:
    """A key ``uni\\u202egnp.exe`` (reads as ``uniexe.png``) and one with a zero-width space
    appear with those characters as ``\\u202e`` and ``\\u200b``, never raw."""
    store, app = sqlite_app
    keys = ["uni\u202egnp.exe", "pay\u200bment:1"]
    for key in keys:
        lease = store.claim(key, owner="w", ttl=60)
        assert lease is not None and store.kill(lease, reason="why\u2066 not")
    client = Client(app)
    for page in (client.get("/dead").text, client.get("/key", key=keys[0]).text):
        assert "\u202e" not in page and "\u200b" not in page and "\u2066" not in page
    assert "uni\\u202egnp.exe" in client.get("/dead").text
    assert "pay\\u200bment:1" in client.get("/dead").text


def test_a_timeline_over_a_huge_span_stays_small(sqlite_app: tuple[Store, WebApp]) -> None:
    """History entries 6e10 s apart (a bad clock, a doctored row): the key page's timeline
    has about ten ticks, not one per week (that was 20 MB of SVG)."""
    from lease_celery.models import HistoryEntry

    store, app = sqlite_app
    lease = store.claim("far:1", owner="w", ttl=60)
    assert lease is not None
    store.record_history_many([HistoryEntry("far:1", 1.0, "lapsed", "w", 1, 1, None),
                               HistoryEntry("far:1", 6e10, "retry", "w", 1, 1, None)])
    page = Client(app).get("/key", key="far:1")
    assert page.status == 200
    svg = page.text[page.text.index("<svg"):page.text.index("</svg>")]
    assert len(svg) < 50_000, len(svg)
    assert 3 <= svg.count("<line") <= 60


def test_resolving_a_receipt_whose_attempt_still_runs_is_refused(
        sqlite_app: tuple[Store, WebApp]) -> None:
    """An in-flight receipt under a current lease: /resolve answers 409 and changes nothing,
    as /discard does; once the lease is gone, resolving works."""
    store, app = sqlite_app
    lease = store.claim("job:live", owner="w", ttl=600)
    assert lease is not None
    assert store.effect_insert("mail:live", "fp", lease)
    dead = store.claim("job:dead", owner="w", ttl=60)
    assert dead is not None and store.kill(dead, reason="boom")
    client = Client(app)
    csrf = client.get("/key", key="job:dead").csrf()  # a page with a form: the session's
    reply = client.post("/resolve", "mail:live", {"csrf": csrf, "token": TOKEN,
                                                  "result": '"sent"'})
    assert reply.status == 409, reply.text
    assert "being performed" in reply.text
    receipt = store.effects.get("mail:live")
    assert receipt is not None and receipt.state is EffectState.IN_FLIGHT
    assert store.release(lease)
    reply = client.post("/resolve", "mail:live", {"csrf": csrf, "token": TOKEN,
                                                  "result": '"sent"'})
    assert reply.status == 200, reply.text
    receipt = store.effects.get("mail:live")
    assert receipt is not None and receipt.state is EffectState.DONE


@pytest.mark.parametrize("length", ["-1", None, "abc"])
def test_a_form_without_a_usable_length_is_refused_before_it_is_read(
        sqlite_app: tuple[Store, WebApp], length: str | None) -> None:
    """A negative, missing or malformed Content-Length: 400 before a byte of the body is read
    (read(-1) used to take the whole body, before any token check)."""
    _, app = sqlite_app

    class Untouchable(io.RawIOBase):
        def read(self, size: int = -1) -> bytes:
            raise AssertionError(f"the body was read ({size})")

    # WSGI: an absent Content-Length may be given as empty.
    reply = Client(app).request("POST", "/resolve", {"key": "x"}, {"token": TOKEN}, headers={
        "wsgi.input": Untouchable(), "CONTENT_LENGTH": "" if length is None else length})
    assert reply.status == 400, reply.text


def test_a_short_operator_token_is_refused(sqlite_url: str) -> None:
    """``token="a"`` was accepted: one guess in 16 at the first character."""
    for short in ("a", "x" * 15):
        with pytest.raises(ConfigError, match="at least 16"):
            make_app(sqlite_url, token=short)
    make_app(sqlite_url, token="x" * 16).close()


def test_token_guessing_is_answered_429_after_five_wrong_tokens(
        sqlite_app: tuple[Store, WebApp]) -> None:
    """Five wrong tokens from one client in a minute, then 429 (with Retry-After), even for
    the right token; another client is not held up; nothing is changed meanwhile."""
    store, app = sqlite_app
    lease = store.claim("job:dead", owner="w", ttl=60)
    assert lease is not None and store.kill(lease, reason="boom")
    client = Client(app)
    csrf = client.get("/key", key="job:dead").csrf()
    for attempt in range(5):
        reply = client.post("/requeue", "job:dead", {"csrf": csrf, "token": f"guess-{attempt}"})
        assert reply.status == 403, reply.text
    for token in ("guess-5", TOKEN):
        reply = client.post("/requeue", "job:dead", {"csrf": csrf, "token": token})
        assert reply.status == 429, reply.text
        assert reply.header("Retry-After") == "60"
    record = store.get("job:dead")
    assert record is not None and record.state is LeaseState.DEAD
    other = Client(app)
    other_csrf = other.get("/key", key="job:dead").csrf()
    reply = other.post("/requeue", "job:dead", {"csrf": other_csrf, "token": TOKEN},
                       headers={"REMOTE_ADDR": "10.0.0.2"})
    assert reply.status == 200, reply.text


def test_the_default_hosts_are_the_loopback_names(sqlite_url: str) -> None:
    """Without ``allowed_hosts`` a page asked for under another name (DNS rebinding) is 400;
    ``allowed_hosts=["*"]`` answers any name."""
    web = make_app(sqlite_url, token=TOKEN)
    try:
        for host in ("127.0.0.1:8765", "localhost", "[::1]:80"):
            assert Client(web, host=host).get("/").status == 200, host
        assert Client(web, host="attacker.example:8765").get("/").status == 400
    finally:
        web.close()
    anything = make_app(sqlite_url, token=TOKEN, allowed_hosts=["*"])
    try:
        assert Client(anything, host="leases.example.com").get("/").status == 200
    finally:
        anything.close()


def test_processes_behind_one_url_accept_each_others_forms(sqlite_url: str) -> None:
    """Two dashboards with one token (two processes behind a balancer): a form served by one
    is accepted by the other (the CSRF secret was per process: random "Form expired")."""
    with open_store(sqlite_url) as store:
        lease = store.claim("job:dead", owner="w", ttl=60)
        assert lease is not None and store.kill(lease, reason="boom")
    first, second = make_app(sqlite_url, token=TOKEN), make_app(sqlite_url, token=TOKEN)
    try:
        browser = Client(first)
        csrf = browser.get("/key", key="job:dead").csrf()
        browser.app = second
        reply = browser.post("/requeue", "job:dead", {"csrf": csrf, "token": TOKEN})
        assert reply.status == 200, reply.text
    finally:
        first.close()
        second.close()


def test_protect_reads_shows_nothing_before_the_browser_signs_in(sqlite_url: str) -> None:
    """``protect_reads=True``: every page is a 401 sign-in form that shows nothing of the
    store (not the key, not its reason) until this browser's session signed in with the
    token; a wrong token is refused (and counts as a guess); the stylesheet stays open; the
    sign-in cookie of one session is worthless to another."""
    with open_store(sqlite_url) as store:
        lease = store.claim("secret:key", owner="w", ttl=60)
        assert lease is not None and store.kill(lease, reason="card 4242 declined")
    web = make_app(sqlite_url, token=TOKEN, protect_reads=True)
    try:
        browser = Client(web)
        for path, query in [("/", {}), ("/dead", {}), ("/key", {"key": "secret:key"})]:
            page = browser.get(path, **query)
            assert page.status == 401, (path, page.status)
            assert "secret:key" not in page.text and "4242" not in page.text
            assert 'id="sign-in"' in page.text
        assert browser.get("/static/dashboard.css").status == 200
        csrf = browser.get("/dead").csrf()
        wrong = browser.request("POST", "/sign-in", {"next": "/dead"},
                                {"csrf": csrf, "token": "not-the-token-at-all"})
        assert wrong.status == 403 and browser.get("/dead").status == 401
        session = browser.cookie
        signed = browser.request("POST", "/sign-in", {"next": "/dead"},
                                 {"csrf": csrf, "token": TOKEN})
        assert signed.status == 200, signed.text
        cookie = signed.header("Set-Cookie") or ""
        assert cookie.startswith("lease_celery_signed_in=") and "HttpOnly" in cookie
        browser.cookie = f"{session}; {cookie.split(';', 1)[0]}"
        page = browser.get("/dead")
        assert page.status == 200 and "4242" in page.text
        stranger = Client(web)
        stranger.get("/")
        stranger.cookie = f"{stranger.cookie}; {cookie.split(';', 1)[0]}"
        assert stranger.get("/dead").status == 401
    finally:
        web.close()
    with pytest.raises(ConfigError, match="protect_reads needs an operator token"):
        make_app(sqlite_url, protect_reads=True)


def test_the_running_page_reads_every_rows_history_at_once(
        sqlite_app: tuple[Store, WebApp], monkeypatch: pytest.MonkeyPatch) -> None:
    """/running with 30 rows: one history read for all of them (it was one per row)."""
    store, app = sqlite_app
    for n in range(30):
        assert store.claim(f"run:{n}", owner="w", ttl=600) is not None
    calls: list[str] = []
    for name in ("history", "history_many"):
        real = getattr(app.store, name)
        monkeypatch.setattr(app.store, name,
                            lambda *a, _real=real, _name=name, **k: calls.append(_name)
                            or _real(*a, **k))
    page = Client(app).get("/running", limit="100")
    assert page.status == 200 and page.text.count('href="/key?key=run%3A') == 30
    assert calls == ["history_many"], calls
