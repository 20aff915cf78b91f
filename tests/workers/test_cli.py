"""``celery -A tests.support.worker_app leases …`` and ``python -m lease_celery …``: the real
commands in subprocesses, against real stores (rows made through the store API).

Exit codes: 0 done; 1 the key is missing or not in a state that allows the action; 2 bad usage.
``--json`` output is parsed with ``json.loads``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from lease_celery import EffectOutcomeUnknown, LeaseState, Store, open_store
from lease_celery.checks import encode_checkpoint
from tests.conftest import fresh_store_url
from tests.support.policy_helpers import (
    CELERY,
    PYTHON_M,
    cli_env,
    get_record,
    parse_json,
    run_cli,
    wait_until,
)
from tests.support.tokens import token_base
from tests.support.workers import WorkerPool

Cli = Callable[..., CompletedProcess[str]]


@pytest.fixture
def lease_url(request: pytest.FixtureRequest) -> str:
    """The store the commands act on: SQLite, unless parametrized indirectly with another."""
    return fresh_store_url(request, getattr(request, "param", "sqlite"))


@pytest.fixture
def store(lease_url: str) -> Iterator[Store]:
    with open_store(lease_url) as opened:
        yield opened


@pytest.fixture
def cli(lease_url: str, tmp_path: Path) -> Cli:
    """Run the leases command of tests.support.worker_app, whose lease_store_url is
    ``lease_url``."""
    env = cli_env(lease_url)

    def run(*args: str, program: list[str] = CELERY) -> CompletedProcess[str]:
        return run_cli(list(args), env=env, cwd=tmp_path, program=program)

    return run


def _populate(store: Store) -> dict[str, int]:
    """a:run running (owner w1), a:done done, b:dead dead, b:ready ready; returns tokens
    (each the key's first: base + 1, tests/support/tokens.py)."""
    running = store.claim("a:run", owner="w1", ttl=600)
    assert running is not None
    done = store.claim("a:done", owner="w2", ttl=600)
    assert done is not None and store.finish(done, {"ok": True})
    dead = store.claim("b:dead", owner="w2", ttl=600)
    assert dead is not None and store.kill(dead, reason="given up")
    ready = store.claim("b:ready", owner="w3", ttl=600)
    assert ready is not None and store.release(ready, reason="later")
    first = token_base(store) + 1
    assert [lease.token for lease in (running, done, dead, ready)] == [first] * 4
    return {"a:run": first, "a:done": first, "b:dead": first, "b:ready": first}


def test_list_filters_by_state_prefix_and_owner(store: Store, cli: Cli) -> None:
    """``list`` prints a table (KEY, STATE, TOKEN, TRIES/TAKEOVERS, EXPIRES, OWNER) of every
    lease; ``--state``, ``--prefix`` and ``--owner`` filter it (combined: all must match);
    ``--json`` gives the records; an unknown state is a usage error (exit 2)."""
    _populate(store)
    table = cli("list")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["KEY", "STATE", "TOKEN", "TRIES/TAKEOVERS", "EXPIRES", "OWNER"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(rows) == {"a:run", "a:done", "b:dead", "b:ready"}
    assert rows["a:run"][1:4] == ["running", "1", "1/0"]
    assert rows["a:run"][4:6] == ["in", rows["a:run"][5]] and rows["a:run"][-1] == "w1"
    assert rows["b:dead"][1] == "dead" and rows["b:dead"][4] == "-"
    # The columns line up: every row's STATE starts where the header's does.
    column = lines[0].index("STATE")
    assert all(line[column:].split()[0] in {s.value for s in LeaseState} for line in lines[1:])

    def keys(*args: str) -> set[str]:
        proc = cli("--json", "list", *args)
        assert proc.returncode == 0, proc.stderr
        return {row["key"] for row in parse_json(proc)}

    assert keys("--state", "dead") == {"b:dead"}
    assert keys("--prefix", "a:") == {"a:run", "a:done"}
    assert keys("--owner", "w1") == {"a:run"}
    assert keys("--prefix", "b:", "--state", "ready") == {"b:ready"}
    assert keys("--prefix", "a:", "--owner", "w3") == set()
    assert len(keys("--limit", "2")) == 2
    assert cli("list", "--state", "sleeping").returncode == 2


def test_show_prints_one_record_and_exits_1_when_missing(store: Store, cli: Cli) -> None:
    """``show KEY`` prints the record's fields (state, owner, token, attempts, reason, and a
    running key's checkpoint as JSON); ``--json`` the same as a dict; a missing key exits 1
    with a message (a JSON error object under ``--json``)."""
    _populate(store)
    long = store.claim("c:long", owner="w4", ttl=600)
    assert long is not None
    assert store.checkpoint(long, encode_checkpoint({"done": 3, "of": 10, "site": "é"}))
    text = cli("show", "c:long")
    assert text.returncode == 0, text.stderr
    record_part = text.stdout.split("\n    history (")[0]
    fields = {name.strip(): value for name, value in
              (line.split(": ", 1) for line in record_part.splitlines())}
    assert fields["state"] == "running" and fields["owner"] == "w4"
    assert json.loads(fields["checkpoint"]) == {"done": 3, "of": 10, "site": "é"}
    data = parse_json(cli("--json", "show", "c:long"))
    assert (data["key"], data["checkpoint"]) == ("c:long", {"done": 3, "of": 10, "site": "é"})
    text = cli("show", "b:dead")
    assert text.returncode == 0, text.stderr
    record_part = text.stdout.split("\n    history (")[0]  # then the last few events
    fields = {name.strip(): value for name, value in
              (line.split(": ", 1) for line in record_part.splitlines())}
    assert fields["state"] == "dead" and fields["token"] == "1"
    assert fields["reason"] == "given up" and fields["owner"] == "w2"
    data = parse_json(cli("--json", "show", "a:done"))
    assert (data["key"], data["state"], data["token"], data["result"]) == (
        "a:done", "done", 1, {"ok": True})
    missing = cli("show", "nope")
    assert missing.returncode == 1
    assert "no lease for key 'nope'" in missing.stderr
    missing = cli("--json", "show", "nope")
    assert missing.returncode == 1 and "error" in parse_json(missing)


def test_release_makes_a_running_lease_ready_and_refuses_its_holder(
        store: Store, cli: Cli) -> None:
    """``release KEY`` turns a running lease ready whoever holds it (reason recorded); the
    holder can then neither renew nor finish, and the next claim gets the next token.
    Releasing a lease that is not running (ready, done, missing) exits 1."""
    holder = store.claim("held", owner="stuck-worker", ttl=600)
    assert holder is not None
    proc = cli("release", "held", "--reason", "stuck for an hour")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "released held"
    record = store.get("held")
    assert record is not None
    assert (record.state, record.token, record.reason) == (
        LeaseState.READY, 1, "stuck for an hour")
    assert store.renew(holder, ttl=600) is None
    assert store.finish(holder, "late result") is False
    again = cli("release", "held")
    assert again.returncode == 1 and "is not running (ready)" in again.stderr
    assert cli("--json", "release", "missing").returncode == 1
    successor = store.claim("held", owner="w2", ttl=600)
    assert successor is not None and successor.token == 2


def test_requeue_without_publish_and_refusals(store: Store, cli: Cli) -> None:
    """``requeue --no-publish KEY`` turns a dead lease ready with attempts reset (token kept);
    a key that is not dead exits 1; publishing a lease that recorded no task exits 1 with a
    message saying so (the key is ready all the same)."""
    _populate(store)
    proc = cli("--json", "requeue", "--no-publish", "b:dead")
    assert proc.returncode == 0, proc.stderr
    assert parse_json(proc) == {"requeued": "b:dead", "task_id": None}
    record = store.get("b:dead")
    assert record is not None
    assert (record.state, record.token, record.attempts) == (LeaseState.READY, 1, 0)
    assert cli("requeue", "b:dead").returncode == 1
    assert cli("requeue", "a:done").returncode == 1
    assert cli("requeue", "missing").returncode == 1

    lease = store.claim("no-task", owner="w", ttl=600)
    assert lease is not None and store.kill(lease, reason="x")
    unpublished = cli("requeue", "no-task")
    assert unpublished.returncode == 1
    assert "cannot be re-published" in unpublished.stderr
    record = store.get("no-task")
    assert record is not None and record.state is LeaseState.READY


# (PostgreSQL keeps a purged key's token in a tombstone row: tests/stores covers it there.)
@pytest.mark.parametrize("lease_url", ["sqlite", "redis"], indirect=True)
def test_purge_keeps_recent_rows_and_recreated_keys_continue_their_tokens(
        store: Store, cli: Cli) -> None:
    """``purge --older-than 7d`` deletes nothing recent; ``purge --older-than 0s`` deletes the
    done and dead rows (never running or ready ones); a purged key claimed again gets a token
    larger than any it had. A bad duration or a missing option is a usage error (exit 2)."""
    tokens = _populate(store)
    again = store.claim("a:done2", owner="w", ttl=600)
    assert again is not None and store.release(again)
    again = store.claim("a:done2", owner="w", ttl=600)
    base = token_base(store)
    assert again is not None and again.token == base + 2 and store.finish(again, None)
    tokens["a:done2"] = base + 2

    kept = cli("--json", "purge", "--older-than", "7d")
    assert kept.returncode == 0, kept.stderr
    assert parse_json(kept) == {"purged": 0}
    time.sleep(0.01)
    purged = cli("purge", "--older-than", "0s")
    assert purged.returncode == 0, purged.stderr
    assert purged.stdout.strip() == "purged 3 lease(s)"
    assert {r.key for r in store.find()} == {"a:run", "b:ready"}
    for key in ("a:done", "b:dead", "a:done2"):
        assert store.get(key) is None
        lease = store.claim(key, owner="new", ttl=600)
        assert lease is not None and lease.token == tokens[key] + 1, key

    assert cli("purge", "--older-than", "3x").returncode == 2
    assert cli("purge", "--older-than", "-1s").returncode == 2
    assert cli("purge").returncode == 2


def test_stats_counts_by_state_and_expired(lease_url: str, cli: Cli) -> None:
    """``stats`` counts leases by state and the running ones whose lease has run out."""
    with open_store(lease_url) as store:
        _populate(store)
        assert store.claim("short", owner="w", ttl=0.05) is not None
    time.sleep(0.1)
    data = parse_json(cli("--json", "stats"))
    assert data == {"counts": {"running": 2, "done": 1, "dead": 1, "ready": 1},
                    "expired": 1, "total": 5}
    text = cli("stats")
    assert text.returncode == 0
    lines = dict(line.strip().split(": ", 1) for line in text.stdout.splitlines())
    assert (lines["running"], lines["done"], lines["dead"], lines["ready"]) == (
        "2", "1", "1", "1")
    assert lines["expired"].startswith("1 ")


def test_python_m_lease_celery_and_store_option(lease_url: str, tmp_path: Path) -> None:
    """``python -m lease_celery -A tests.support.worker_app …`` runs the same commands;
    ``--store URL``
    (before or after the command) picks another store; without ``-A`` every command is a
    usage error (exit 2), ``--store`` or not, as is an unknown command."""
    with open_store(lease_url) as store:
        _populate(store)
    env = cli_env(lease_url)
    other_url = f"sqlite:///{tmp_path}/other.sqlite3"

    def run(*args: str) -> CompletedProcess[str]:
        return run_cli(list(args), env=env, cwd=tmp_path, program=PYTHON_M)

    data = parse_json(run("--json", "stats"))
    assert data["total"] == 4
    assert parse_json(run("--json", "show", "b:dead"))["state"] == "dead"
    assert run("show", "nope").returncode == 1
    # A --store given after -A overrides the app's store.
    other = parse_json(run("--store", other_url, "--json", "stats"))
    assert other["total"] == 0
    listed = run("--json", "list", "--state", "dead", "--store", lease_url)
    assert listed.returncode == 0, listed.stderr
    assert [r["key"] for r in parse_json(listed)] == ["b:dead"]
    assert run("frobnicate").returncode == 2

    bare = [PYTHON_M[0], "-m", "lease_celery"]
    for args in (["stats"], ["--store", lease_url, "list"], ["--store", lease_url, "sweep"],
                 ["--store", lease_url, "doctor"]):
        proc = run_cli(args, env=env, cwd=tmp_path, program=bare)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)


@pytest.mark.worker
@pytest.mark.worker_env(LEASE_TEST_TTL="1", LEASE_TEST_HEARTBEAT="0.25",
                        LEASE_TEST_SWEEP_INTERVAL="0")
def test_cli_sweep_republishes_an_expired_lease_when_workers_do_not_sweep(
        workers: WorkerPool, tmp_path: Path) -> None:
    """With the workers' sweeper off (lease_sweep_interval=0) and the default visibility
    timeout, a task whose worker was SIGKILLed stays running-and-expired; ``celery leases
    sweep`` re-publishes it (JSON: the swept keys), a worker takes it over under token 2 and
    completes it; a second sweep finds nothing."""
    doomed = workers.start("doomed", concurrency=1)
    job, task_id = uuid.uuid4().hex[:10], str(uuid.uuid4())
    result = workers.client.send_task("tests.support.worker_app.work", args=(job, 0.5),
                                      task_id=task_id)
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                             what="the doomed worker to start the task")
    doomed.kill()
    workers.start("survivor", concurrency=1)
    key = f"job:{job}"
    with open_store(workers.store_url) as store:
        wait_until(lambda: (r := store.get(key)) is not None and r.expires_at is not None
                   and r.expires_at + 0.5 < store.now(), timeout=10, what="expiry")
    record = get_record(workers.store_url, key)
    assert record is not None and (record.state, record.token) == (LeaseState.RUNNING, 1)
    assert not workers.journal.events("lease_swept")  # nobody swept meanwhile

    env = cli_env(workers.store_url, {"LEASE_TEST_QUEUE": workers.env["LEASE_TEST_QUEUE"],
                                      "LEASE_TEST_JOURNAL": workers.env["LEASE_TEST_JOURNAL"],
                                      "LEASE_TEST_SWEEP_INTERVAL": "0"})
    proc = run_cli(["--json", "sweep"], env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert parse_json(proc) == {"swept": [key], "failed": [], "no_task": [], "handed_on": []}
    assert result.get(timeout=30)["token"] == 2
    again = run_cli(["sweep"], env=env, cwd=tmp_path)
    assert again.returncode == 0 and again.stdout.strip() == "re-published 0 task(s)"
    record = get_record(workers.store_url, key)
    assert record is not None and (record.state, record.token) == (LeaseState.DONE, 2)


def _show_fields(cli: Cli, key: str) -> dict[str, str]:
    text = cli("show", key)
    assert text.returncode == 0, text.stderr
    record_part = text.stdout.split("\n    history (")[0]
    return {name.strip(): value for name, value in
            (line.split(": ", 1) for line in record_part.splitlines())}


def test_show_says_no_one_holds_a_key_that_ended_or_lapsed(store: Store, cli: Cli) -> None:
    """``show`` on a key no one holds never counts down to its old deadline: a done, dead or
    released key's expires_at says "released" (its lease ended with the key's state), and a
    running row past its deadline says "expired … ago"; a held lease still says "in Ns"."""
    _populate(store)
    lapsed = store.claim("c:lapsed", owner="w5", ttl=0.05)
    assert lapsed is not None
    time.sleep(0.2)
    for key, state in (("a:done", "done"), ("b:dead", "dead"), ("b:ready", "ready")):
        expires = _show_fields(cli, key)["expires_at"]
        assert f"released: the key is {state}, no one holds it" in expires, expires
        assert "(in " not in expires, expires
    expires = _show_fields(cli, "c:lapsed")["expires_at"]
    assert "(expired " in expires and "s ago: no one holds it" in expires, expires
    assert "(in " in _show_fields(cli, "a:run")["expires_at"]


def test_list_hides_internal_rows_unless_all(store: Store, cli: Cli) -> None:
    """Rows lease_celery writes for itself, not under a user's key (the answer to a duplicate
    under another task id, ``KEY#answer:ID``; a direct call with no lease_key,
    ``direct:UUID``), are left out of ``list`` with a footer that counts them; ``--all``
    lists them, each named for what it is."""
    _populate(store)
    for key in ("notify:1#answer:0f1e", f"direct:{uuid.uuid4()}"):
        lease = store.claim(key, owner="w6", ttl=600)
        assert lease is not None and store.finish(lease, None)
    shown = cli("list")
    assert shown.returncode == 0, shown.stderr
    assert "#answer:" not in shown.stdout and "direct:" not in shown.stdout, shown.stdout
    assert "2 internal rows hidden" in shown.stdout and "--all" in shown.stdout, shown.stdout
    assert {r["key"] for r in parse_json(cli("--json", "list"))} == {
        "a:run", "a:done", "b:dead", "b:ready"}
    every = cli("list", "--all")
    assert every.returncode == 0, every.stderr
    lines = every.stdout.splitlines()
    answer = next(line for line in lines if line.startswith("notify:1#answer:0f1e"))
    direct = next(line for line in lines if line.startswith("direct:"))
    assert "answer to a duplicate" in answer and "direct call" in direct, every.stdout
    assert len(parse_json(cli("--json", "list", "--all"))) == 6
    shown = cli("show", "notify:1#answer:0f1e")
    assert shown.returncode == 0 and "answer to a duplicate" in shown.stdout, shown.stdout


def _unknown_outcome(store: Store, key: str, lease_key: str) -> str:
    """A receipt left needs_reconciliation (its action timed out after the request went out);
    returns what the next attempt is told (the dead reason of a key that dies of it)."""
    lease = store.claim(lease_key, owner="w7", ttl=600)
    assert lease is not None

    def timed_out(idempotency_key: str) -> None:
        raise EffectOutcomeUnknown("read timeout after the request was sent")

    with pytest.raises(EffectOutcomeUnknown):
        store.effects.once(key, {"amount": 5}, timed_out, lease=lease)
    with pytest.raises(EffectOutcomeUnknown) as told:
        store.effects.once(key, {"amount": 5}, timed_out, lease=lease)
    return str(told.value)


def test_effects_lists_resolves_and_discards_receipts(store: Store, cli: Cli) -> None:
    """``effects`` lists receipts (``--state`` filters; needs_reconciliation is the queue a
    person works through); ``effects resolve KEY --result JSON`` records that the action
    happened (replays return the result), ``effects discard KEY`` that it did not (the next
    attempt performs it); each is an operator action recorded in the lease's history; a
    missing receipt exits 1, a result that is not JSON is a usage error (exit 2). The message
    that sends a person to reconcile names these commands."""
    told = _unknown_outcome(store, "refund:1", "order:1")
    _unknown_outcome(store, "refund:2", "order:2")
    done = store.claim("order:3", owner="w7", ttl=600)
    assert done is not None
    store.effects.once("refund:3", {"amount": 1}, lambda k: {"id": 3}, lease=done)
    assert "celery -A APP leases effects resolve refund:1 --result JSON" in told, told
    assert "leases effects discard refund:1" in told, told

    listed = cli("effects")
    assert listed.returncode == 0, listed.stderr
    assert {line.split()[0] for line in listed.stdout.splitlines()[1:]} == {
        "refund:1", "refund:2", "refund:3"}, listed.stdout
    waiting = parse_json(cli("--json", "effects", "--state", "needs_reconciliation"))
    assert {r["key"] for r in waiting} == {"refund:1", "refund:2"}
    assert {r["state"] for r in waiting} == {"needs_reconciliation"}

    assert cli("effects", "resolve", "refund:1", "--result", "{not json").returncode == 2
    resolved = cli("effects", "resolve", "refund:1", "--result", '{"id": 1}')
    assert resolved.returncode == 0, resolved.stderr
    receipt = store.effects.get("refund:1")
    assert receipt is not None and receipt.state.value == "done"
    assert receipt.result == {"id": 1}
    assert store.effects.once("refund:1", {"amount": 5}, lambda k: {"id": 99}) == {"id": 1}
    again = cli("effects", "resolve", "refund:1", "--result", "{}")
    assert again.returncode == 1 and "done already" in again.stderr

    discarded = cli("effects", "discard", "refund:2")
    assert discarded.returncode == 0, discarded.stderr
    assert store.effects.get("refund:2") is None
    assert cli("effects", "discard", "refund:2").returncode == 1

    events = {(e.key, e.event) for key in ("order:1", "order:2")
              for e in store.history(key)}
    assert ("order:1", "operator:resolve") in events
    assert ("order:2", "operator:discard") in events
    assert [r["key"] for r in parse_json(cli("--json", "effects", "--state",
                                             "needs_reconciliation"))] == []
