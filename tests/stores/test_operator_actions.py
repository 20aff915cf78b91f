"""Operator actions are written once (``lease_celery.ops``): the CLI and the web dashboard
call the same functions, and the same action leaves the same history entry whichever
interface took it, naming who acted."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner

from lease_celery import LeaseState, Store, open_store
from lease_celery.cli import leases
from lease_celery.errors import EffectOutcomeUnknown
from lease_celery.ops import ACTIONS, LIMIT_KEY_PREFIX, STORE_KEY, Operations, Refusal
from lease_celery.web import WebApp
from tests.stores.test_web import TOKEN, Client

PACKAGE = Path(__file__).resolve().parents[2] / "lease_celery"
#: The store's writes an operator action makes: only lease_celery.ops calls them.
ACTION_WRITES = {"force_release", "cancel", "requeue", "purge_older_than", "set_limit",
                 "hand_on", "reset_epoch", "resolve", "discard", "record_history"}


def _dead(store: Store, key: str) -> None:
    lease = store.claim(key, owner="w", ttl=600)
    assert lease is not None and store.kill(lease, reason="gave up")


def _operator_entries(store: Store, key: str) -> list[tuple[str, int | None, str, str]]:
    """(event, token, actor, what) of the key's operator entries."""
    found = []
    for entry in store.history(key):
        if entry.event.startswith("operator:"):
            actor, _, what = (entry.detail or "").partition(": ")
            found.append((entry.event, entry.token, actor, what))
    return found


def test_the_cli_and_the_web_call_the_same_action_and_record_it_alike(
        sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A requeue from ``celery leases requeue`` and one from the dashboard both go through
    ``Operations.requeue`` and leave one entry each, the same but for the actor."""
    calls: list[tuple[str, str]] = []
    real = Operations.requeue

    def spy(self: Operations, key: str, **options: Any) -> Any:
        calls.append((self.actor, key))
        return real(self, key, **options)

    monkeypatch.setattr(Operations, "requeue", spy)
    with open_store(sqlite_url) as store:
        _dead(store, "cli:1")
        _dead(store, "web:1")
    named = SimpleNamespace(app=Celery("ops", broker="memory://", set_as_current=False),
                            load_error=None)
    done = CliRunner().invoke(leases, ["--store", sqlite_url, "requeue", "cli:1",
                                       "--no-publish"], obj=named)
    assert done.exit_code == 0, done.output
    web = WebApp(open_store(sqlite_url), token=TOKEN)  # no app: nothing published here
    try:
        client = Client(web)
        csrf = client.get("/key", key="web:1").csrf()
        reply = client.post("/requeue", "web:1", {"csrf": csrf, "token": TOKEN,
                                                  "reason": "requeued by an operator"})
    finally:
        web.close()
    assert reply.status == 200, reply.text
    assert [key for _, key in calls] == ["cli:1", "web:1"]
    assert calls[0][0].endswith(" via the CLI") and calls[1][0] == "web 127.0.0.1"
    with open_store(sqlite_url) as store:
        (cli_entry,) = _operator_entries(store, "cli:1")
        (web_entry,) = _operator_entries(store, "web:1")
    assert cli_entry[2] == calls[0][0] and web_entry[2] == calls[1][0]
    assert (cli_entry[0], cli_entry[1], cli_entry[3]) == (web_entry[0], web_entry[1],
                                                          web_entry[3])
    assert cli_entry[0] == "operator:requeue"


@pytest.mark.parametrize("module", ["cli.py", "web/app.py", "web/pages.py", "web/serve.py"])
def test_no_interface_writes_what_an_action_writes_itself(module: str) -> None:
    """The interfaces leave the store's action writes (and the history they are recorded in)
    to lease_celery.ops: none of them calls one."""
    tree = ast.parse((PACKAGE / module).read_text())
    called = {node.func.attr for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and ast.unparse(node.func.value).split(".")[-1] in ("store", "effects")}
    assert called & ACTION_WRITES == set()


def _unknown(key: str) -> None:
    raise EffectOutcomeUnknown("the connection dropped after sending")


def test_every_action_is_recorded_in_one_vocabulary_with_its_actor(stores: list[Store]) -> None:
    """Each action leaves one ``operator:<action>`` entry whose detail starts with the actor:
    on the key, the receipt's lease key, the group (``LIMIT_KEY_PREFIX``) or the store
    (``STORE_KEY``). A refusal records nothing."""
    store = stores[0]
    ops = Operations(store, actor="ann@host via a test")
    assert store.claim("run:1", owner="w", ttl=600) is not None
    ops.release("run:1", reason="stuck")
    ops.cancel("run:1", reason="not wanted")
    ops.requeue("run:1", reason="wanted after all")
    lease = store.claim("pay:1", owner="w", ttl=600)
    assert lease is not None
    for effect in ("refund:1", "refund:2"):
        with pytest.raises(EffectOutcomeUnknown):
            store.effects.once(effect, {"n": effect}, _unknown, lease=lease)
    assert store.kill(lease, reason="gave up")
    ops.resolve("refund:1", {"id": 7})
    ops.discard("refund:2")
    ops.limit("tenants", concurrency=2)
    ops.purge(3600)
    with pytest.raises(Refusal, match="is not running"):
        ops.release("run:1", reason="again")
    with pytest.raises(Refusal, match="no lease") as missing:
        ops.requeue("nope", reason="x")
    assert missing.value.missing
    recorded = {key: _operator_entries(store, key)
                for key in ("run:1", "pay:1", LIMIT_KEY_PREFIX + "tenants",
                            STORE_KEY, "nope")}
    events = [event for entries in recorded.values() for event, *_ in entries]
    assert sorted(events) == sorted(f"operator:{a}" for a in ACTIONS
                                    if a != "reset-epoch")
    assert {actor for entries in recorded.values() for _, _, actor, _ in entries} == {
        "ann@host via a test"}
    record = store.get("run:1")
    assert record is not None and record.state is LeaseState.READY
