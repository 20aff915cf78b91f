"""The dashboard as a WSGI app: a tiny router, the security checks, and the three actions.

Security, in the order a request meets it:

- ``allowed_hosts`` (the CLI server sets the loopback names when it binds to loopback): any
  other ``Host`` header is refused, so a DNS-rebinding page cannot read the dashboard.
- Every response carries ``Content-Security-Policy: default-src 'self'`` (no script at all,
  styles only from ``/static/``), ``X-Frame-Options: DENY``, ``Referrer-Policy: same-origin``
  (keys are in URLs: other sites never see them), ``nosniff`` and ``Cache-Control:
  no-store``. Every user string is escaped.
- Without an operator token the app is read-only: no forms, and every action is refused (403).
- With one, each action is a POST carrying the operator token (compared with
  ``hmac.compare_digest``) and a CSRF token: an HMAC, under a secret made when the app starts,
  of a random session id kept in an ``HttpOnly; SameSite=Strict`` cookie. A cross-site
  ``Origin`` or ``Sec-Fetch-Site`` is refused too. A refusal changes nothing.
- Each action is one of ``lease_celery.ops`` (the CLI's too), recorded there in the key's
  history (``operator:resolve`` / ``operator:discard`` / ``operator:requeue``, detail:
  ``web <client address>: …``).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import http
import json
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

from ..checks import encode_result
from ..errors import ConfigError, LeaseError, StoreError
from ..ops import Done, Operations, Refusal
from ..stores.base import Store
from ..stores.urls import redact
from . import pages
from .html import Safe, h, layout, link, url

__all__ = ["WebApp"]

logger = logging.getLogger(__name__)

COOKIE = "lease_celery_session"
#: With ``protect_reads``: the cookie that says this browser's session signed in with the
#: token (an HMAC of the session id, so any process that knows the secret checks it).
SIGNED_IN = "lease_celery_signed_in"
MAX_BODY = 64 * 1024
#: The shortest operator token accepted.
MIN_TOKEN = 16
#: Wrong operator tokens one client may send per ``GUESS_WINDOW`` seconds before it is
#: answered 429 until the window has passed (1,300 guesses a second were possible).
MAX_GUESSES, GUESS_WINDOW = 5, 60.0
#: The host names a dashboard answers to unless told otherwise (DNS rebinding).
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
SECURITY_HEADERS = [
    ("Content-Security-Policy", "default-src 'self'; script-src 'none'; object-src 'none'; "
     "style-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'self'; "
     "frame-ancestors 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    # Not no-referrer: with it, browsers send "Origin: null" on the dashboard's own forms.
    ("Referrer-Policy", "same-origin"),
    ("Cache-Control", "no-store"),
]
_SESSION = re.compile(r"[0-9a-f]{32}")
StartResponse = Callable[..., Any]


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = "text/html; charset=utf-8"
    headers: list[tuple[str, str]] = field(default_factory=list)


class Refused(Exception):
    """A request the app will not carry out: status, title and a message for the operator."""

    def __init__(self, status: int, title: str, message: str) -> None:
        super().__init__(message)
        self.status, self.title, self.message = status, title, message


def host_name(host: str) -> str:
    """``Host`` header → host name: ``[::1]:8765`` → ``::1``, ``localhost:80`` → ``localhost``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class WebApp:
    """The dashboard over one store: ``WebApp(store, token=...)`` or ``make_app(url, ...)``.

    ``token``: the operator token that every action needs (None: read-only), at least
    ``MIN_TOKEN`` characters. ``app``: a Celery app to re-publish a requeued key's task with
    (None: the row is made ready and a worker's sweeper re-publishes it after
    ``lease_sweep_grace``). ``allowed_hosts``: the only host names accepted in the ``Host``
    header (None: the loopback names; ``["*"]``: any). ``refresh``: seconds between reloads of
    the list pages. ``secret``: what the CSRF tokens are signed with (None: derived from the
    token, so several processes behind one URL accept each other's forms). ``protect_reads``:
    every page, not only every action, needs the token: a browser signs in once per session
    (task args, results and checkpoints are no one else's to read).
    """

    def __init__(self, store: Store, *, token: str | None = None, app: Any = None,
                 allowed_hosts: Sequence[str] | None = None, refresh: int = 5,
                 secret: str | bytes | None = None, protect_reads: bool = False) -> None:
        if token is not None and (not isinstance(token, str) or not token.strip()):
            raise ConfigError("the operator token must be a non-empty string (or None for a "
                              "read-only dashboard)")
        if token is not None and len(token.strip()) < MIN_TOKEN:
            raise ConfigError(f"the operator token is {len(token.strip())} characters long; it "
                              f"must have at least {MIN_TOKEN} (e.g. openssl rand -hex 16): "
                              "it is the one secret between the network and every action")
        if protect_reads and token is None:
            raise ConfigError("protect_reads needs an operator token: pages open to whoever "
                              "signs in with it")
        self.store, self.celery_app, self.refresh = store, app, refresh
        self.protect_reads = protect_reads
        self._token = None if token is None else token.encode("utf-8")
        if secret is not None:
            self._secret = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
        elif self._token is not None:
            self._secret = hmac.new(self._token, b"lease_celery.web.csrf",
                                    hashlib.sha256).digest()
        else:
            self._secret = secrets.token_bytes(32)  # read-only: no forms to sign
        names = LOOPBACK_NAMES if allowed_hosts is None else allowed_hosts
        self._hosts = None if "*" in names else {host_name(h) for h in names}
        self._failures: dict[str, list[float]] = {}
        self._failures_lock = threading.Lock()
        self._css = resources.files(__package__).joinpath("static/dashboard.css").read_bytes()

    @property
    def read_only(self) -> bool:
        return self._token is None

    def close(self) -> None:
        self.store.close()

    # -- WSGI ------------------------------------------------------------------------------

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        base = quote(environ.get("SCRIPT_NAME", "").encode("latin-1", "replace").decode(
            "utf-8", "replace").strip("/"), safe="/")
        # Only a path: "//evil.example" as given made every link a link to another site.
        base = f"/{base}" if base else ""
        try:
            response = self._handle(environ, base)
        except Refused as exc:
            response = self._page(environ, base, exc.title, Safe(
                f'<p class="refused">{h(exc.message)}</p>'), status=exc.status)
            if exc.status == 429:
                response.headers.append(("Retry-After", f"{GUESS_WINDOW:.0f}"))
            if exc.status == 405:
                response.headers.append(("Allow", "POST" if environ.get("PATH_INFO") in _ACTIONS
                                         else "GET, HEAD"))
        except StoreError as exc:
            logger.warning("dashboard: the store could not answer: %s", exc)
            response = self._page(environ, base, "The store did not answer", Safe(
                f'<p class="refused">{h(exc)}</p>'), status=503)
        except LeaseError as exc:  # InvalidKey and the like: the request asked for nonsense
            status = 400 if isinstance(exc, ValueError) else 409
            response = self._page(environ, base, "Refused", Safe(
                f'<p class="refused">{h(exc)}</p>'), status=status)
        except Exception:
            logger.exception("dashboard: request failed")
            response = self._page(environ, base, "Internal error", Safe(
                "<p>The request failed; the server log has the details.</p>"), status=500)
        phrase = http.HTTPStatus(response.status).phrase
        own = {name.lower() for name, _ in response.headers}
        headers = [("Content-Type", response.content_type),
                   ("Content-Length", str(len(response.body))),
                   *[(n, v) for n, v in SECURITY_HEADERS if n.lower() not in own],
                   *response.headers]
        start_response(f"{response.status} {phrase}", headers)
        return [b"" if environ.get("REQUEST_METHOD") == "HEAD" else response.body]

    def _handle(self, environ: dict[str, Any], base: str) -> Response:
        if self._hosts is not None and host_name(environ.get("HTTP_HOST", "")) not in self._hosts:
            raise Refused(400, "Unexpected host", "this dashboard answers only on "
                          + ", ".join(sorted(self._hosts)))
        method = environ.get("REQUEST_METHOD", "GET")
        path = environ.get("PATH_INFO", "") or "/"
        query = _query(environ)
        if path == "/sign-in" and self.protect_reads:
            if method != "POST":
                raise Refused(405, "POST only", "sign in with the form of any page")
            return self._sign_in(environ, base, query)
        if path in _ACTIONS:
            if method != "POST":
                raise Refused(405, "POST only", "actions are POST requests from the "
                              "dashboard's forms; nothing was changed")
            return self._act(environ, base, path, query)
        if method not in ("GET", "HEAD"):
            raise Refused(405, "Method not allowed", f"{method} is not allowed here")
        if path == "/favicon.ico":
            return Response(204, b"", "text/plain")
        if path == "/static/dashboard.css":
            return Response(200, self._css, "text/css; charset=utf-8",
                            [("Cache-Control", "max-age=300")])
        session, new = self._session(environ)
        view = pages.View(self.store, base, None if self.read_only else self._csrf(session))
        if self.protect_reads and not self._signed_in(environ, session):
            page = pages.sign_in(view, next_path=path)
        else:
            page = self._route(view, path, query)
        response = self._page(environ, base, page.title, page.body, status=page.status,
                              refresh=page.refresh)
        if new and not self.read_only:
            secure = "; Secure" if environ.get("wsgi.url_scheme") == "https" else ""
            response.headers.append(("Set-Cookie", f"{COOKIE}={session}; Path={base or '/'}; "
                                                   f"HttpOnly; SameSite=Strict{secure}"))
        return response

    def _route(self, view: pages.View, path: str, query: dict[str, str]) -> pages.Page:
        limit = _limit(query)
        if path == "/":
            return pages.overview(view)
        lists = {"/running": pages.running, "/events": pages.events, "/dead": pages.dead,
                 "/reconcile": pages.reconcile, "/limits": pages.limits}
        if path in lists:
            return lists[path](view, limit=limit)
        if path == "/key":
            key = query.get("key")
            return pages.lookup(view) if not key else pages.key_page(view, key)
        if path == "/receipt":
            if not query.get("key"):
                raise Refused(400, "Which receipt?", "name it: /receipt?key=EFFECT_KEY")
            return pages.receipt_page(view, query["key"])
        raise Refused(404, "Not found", f"no page at {path}")

    def _page(self, environ: dict[str, Any], base: str, title: str, body: Safe, *,
              status: int = 200, refresh: bool = False) -> Response:
        text = layout(title, body, base=base, path=environ.get("PATH_INFO", "") or "/",
                      refresh=self.refresh if refresh else None, read_only=self.read_only,
                      store=redact(self.store.url))
        return Response(status, text.encode("utf-8"))

    # -- sessions and CSRF -----------------------------------------------------------------

    def _session(self, environ: dict[str, Any]) -> tuple[str, bool]:
        """This browser's session id (from its cookie), or a new one: (id, is new)."""
        for value in _cookies(environ, COOKIE):
            if _SESSION.fullmatch(value):
                return value, False
        return secrets.token_hex(16), True

    def _csrf(self, session: str) -> str:
        return hmac.new(self._secret, f"csrf:{session}".encode(), hashlib.sha256).hexdigest()

    def _signature(self, session: str) -> str:
        return hmac.new(self._secret, f"read:{session}".encode(), hashlib.sha256).hexdigest()

    def _signed_in(self, environ: dict[str, Any], session: str) -> bool:
        signature = self._signature(session)
        return any(hmac.compare_digest(value, signature)
                   for value in _cookies(environ, SIGNED_IN))

    def _sign_in(self, environ: dict[str, Any], base: str, query: dict[str, str]) -> Response:
        """The token, once per browser session, for the pages of a ``protect_reads`` app:
        the same checks as an action (same site, this session's CSRF token, the guess
        limit), then a cookie that proves it and a link back to the page asked for."""
        form = _read_form(environ)
        self._authorize(environ, form)
        session, _ = self._session(environ)
        wanted = query.get("next", "/")
        if not wanted.startswith("/") or wanted.startswith("//"):
            wanted = "/"  # only a page of this dashboard
        secure = "; Secure" if environ.get("wsgi.url_scheme") == "https" else ""
        response = self._page(environ, base, "Signed in", Safe(
            f'<p class="ok">Signed in for this browser session.</p><p>Back to: '
            f'{link(url(base, wanted), wanted)}</p>'))
        response.headers.append(("Set-Cookie", f"{SIGNED_IN}={self._signature(session)}; "
                                               f"Path={base or '/'}; HttpOnly; "
                                               f"SameSite=Strict{secure}"))
        return response

    def _authorize(self, environ: dict[str, Any], form: dict[str, str]) -> None:
        """Refuse (403) unless the request is same-site, bound to this browser's session and
        carries the operator token. Checked before anything is read or written."""
        if self._token is None:
            raise Refused(403, "Read-only", "this dashboard was started without an operator "
                          "token, so it takes no actions (start it with --token); nothing was "
                          "changed")
        origin = environ.get("HTTP_ORIGIN")
        if origin is not None and urlsplit(origin).netloc.lower() != environ.get(
                "HTTP_HOST", "").lower():
            raise Refused(403, "Cross-site request refused", f"a form from {origin} may not "
                          "act on this dashboard; nothing was changed")
        if environ.get("HTTP_SEC_FETCH_SITE", "same-origin") not in ("same-origin", "none"):
            raise Refused(403, "Cross-site request refused", "actions come only from the "
                          "dashboard's own pages; nothing was changed")
        client = str(environ.get("REMOTE_ADDR") or "unknown")
        self._refuse_guessing(client)
        session, new = self._session(environ)
        if new or not hmac.compare_digest(form.get("csrf", ""), self._csrf(session)):
            raise Refused(403, "Form expired", "the form's CSRF token is missing or does not "
                          "match this browser's session (the dashboard may have restarted): "
                          "reload the page and try again; nothing was changed")
        if not hmac.compare_digest(form.get("token", "").encode("utf-8"), self._token):
            with self._failures_lock:
                if len(self._failures) > 10_000:  # a flood from many addresses: keep it small
                    self._failures.clear()
                self._failures.setdefault(client, []).append(time.monotonic())
            raise Refused(403, "Wrong operator token", "the operator token is missing or "
                          "wrong; nothing was changed")

    def _refuse_guessing(self, client: str) -> None:
        """429 for a client that sent ``MAX_GUESSES`` wrong tokens in the last window."""
        now = time.monotonic()
        with self._failures_lock:
            recent = [t for t in self._failures.get(client, []) if now - t < GUESS_WINDOW]
            if recent:
                self._failures[client] = recent
            else:
                self._failures.pop(client, None)
        if len(recent) >= MAX_GUESSES:
            raise Refused(429, "Too many wrong tokens", f"{len(recent)} wrong operator tokens "
                          f"from {client} in the last {GUESS_WINDOW:g} s: try again in "
                          f"{GUESS_WINDOW - (now - recent[0]):.0f} s; nothing was changed")

    # -- actions ---------------------------------------------------------------------------

    def _act(self, environ: dict[str, Any], base: str, path: str,
             query: dict[str, str]) -> Response:
        form = _read_form(environ)
        self._authorize(environ, form)
        key = query.get("key", "")
        if not key:
            raise Refused(400, "Which key?", "the action's URL names no key; nothing was changed")
        operations = Operations(self.store, actor=f"web {environ.get('REMOTE_ADDR') or 'unknown'}",
                                app=self.celery_app)
        title, act = _ACTIONS[path]
        try:
            done = act(operations, key, form)
        except Refusal as exc:
            raise Refused(404 if exc.missing else 409, _REFUSALS[path], str(exc)) from exc
        message = _said(done)
        if done.unrecorded is not None:
            message += f" (It could not be recorded in the history: {done.unrecorded}.)"
        links = [link(url(base, "/key", key=done.key), "the key's page and history"),
                 link(url(base, "/reconcile"), "the reconciliation queue"),
                 link(url(base, "/"), "the overview")]
        body = Safe(f'<p class="ok">{h(message)}</p><p>Back to: '
                    + " · ".join(links) + "</p>")
        return self._page(environ, base, title, body)


def _said(done: Done) -> str:
    """What the dashboard tells the operator an action did."""
    if done.action == "resolve":
        return (f"Receipt {done.effect_key!r} is done with result {encode_result(done.result)}:"
                " replays return it. Requeue its lease to run the task again.")
    if done.action == "discard":
        return f"Receipt {done.effect_key!r} is gone: the next attempt performs the action."
    return f"Lease {done.key!r} is ready again (token {done.token}); {done.outcome}."


#: path -> (the page's title, the action): each one of lease_celery.ops, shared with the CLI.
_ACTIONS: dict[str, tuple[str, Callable[[Operations, str, dict[str, str]], Done]]] = {
    "/resolve": ("Resolved", lambda ops, key, form: ops.resolve(
        key, _parse_result(form.get("result", "")))),
    "/discard": ("Discarded", lambda ops, key, form: ops.discard(key)),
    "/requeue": ("Requeued", lambda ops, key, form: ops.requeue(
        key, reason=form.get("reason", "").strip() or "requeued from the web dashboard")),
}
#: path -> the title of its refusal page.
_REFUSALS = {"/resolve": "Not resolved", "/discard": "Not discarded", "/requeue": "Not requeued"}


def _query(environ: dict[str, Any]) -> dict[str, str]:
    raw = environ.get("QUERY_STRING", "")
    with contextlib.suppress(UnicodeError):  # PEP 3333: bytes as latin-1; a client that
        raw = raw.encode("latin-1").decode("utf-8")  # did not percent-encode sent UTF-8
    try:
        parsed = parse_qs(raw, keep_blank_values=True, max_num_fields=10)
    except ValueError as exc:
        raise Refused(400, "Bad query", str(exc)) from exc
    return {name: values[0] for name, values in parsed.items()}


def _limit(query: dict[str, str]) -> int:
    try:
        return min(1000, max(1, int(query.get("limit", "100"))))
    except ValueError:
        return 100


def _cookies(environ: dict[str, Any], wanted: str) -> Iterator[str]:
    """The values of the request's cookies named ``wanted``, in the order sent."""
    for part in environ.get("HTTP_COOKIE", "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == wanted:
            yield value


def _read_form(environ: dict[str, Any]) -> dict[str, str]:
    kind = environ.get("CONTENT_TYPE", "").split(";", 1)[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise Refused(415, "Not a form", "actions take application/x-www-form-urlencoded "
                      "forms; nothing was changed")
    # Refused before reading: read(-1) would take the whole body, however large, and the
    # token is checked only once the form is read.
    raw = str(environ.get("CONTENT_LENGTH") or "").strip()
    if not raw:
        raise Refused(400, "Bad request", "a form needs a Content-Length; nothing was changed")
    try:
        length = int(raw)
    except ValueError:
        raise Refused(400, "Bad request", "bad Content-Length") from None
    if length < 0:
        raise Refused(400, "Bad request", f"Content-Length {length} is negative; nothing was "
                      "read or changed")
    if length > MAX_BODY:
        raise Refused(413, "Too large", f"forms are at most {MAX_BODY} bytes")
    try:
        text = environ["wsgi.input"].read(length).decode("utf-8")
        parsed = parse_qs(text, keep_blank_values=True, max_num_fields=10)
    except (UnicodeError, ValueError) as exc:
        raise Refused(400, "Bad form", f"the form could not be read: {exc}") from exc
    return {name: values[0] for name, values in parsed.items()}


def _parse_result(text: str) -> Any:
    """The operator's result: JSON if it parses (``{"id": 7}``, ``"sent"``, ``3``), else the
    text itself as a string; empty means None."""
    if not text.strip():
        return None
    try:
        value = json.loads(text)
        encode_result(value)  # NaN and the like: keep the text
        return value
    except (ValueError, LeaseError):
        return text
