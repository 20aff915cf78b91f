"""The chaos harness (benchmarks/chaos): its checker can fail, and a short run passes.

The checker tests feed a doctored history (built here, no servers, milliseconds): a clean
history passes, and each check fails on the one defect it exists to catch, so a green chaos run
means something. The run tests start the real harness (``python -m benchmarks.chaos``, 200
tasks, every fault that applies to the store) once per store and assert that it passes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from benchmarks.chaos.checker import CHECKS, check, deaths
from benchmarks.chaos.config import CALLBACK_TASK, JOB_TASK, PLAIN_CALLBACK_TASK
from benchmarks.chaos.history import BackendEntry, BrokerMessage, History, Published, Row
from benchmarks.chaos.txchecks import TX_CHECKS
from tests.support.chaos import run_chaos
from tests.support.servers import (
    mysql_reachable,
    postgres_reachable,
    rabbitmq_reachable,
    redis_reachable,
    require,
)

# -- a doctored history ------------------------------------------------------------------------
# j1: original A (re-sent with the same id) and alias B; its first worker (group 10: pids 10, 11,
#     12) is killed, pid 21 takes over and finishes with token 2; B stays PENDING.
# j2: original C, finished by pid 12, which writes its result and is killed before its ack; the
#     redelivery on pid 21 writes the result again: allowed, the first writer was dead.
# j3: original D, dead: its effect needs reconciliation (the receiver got it once).

A, B, C, D = "id-a", "id-b", "id-c", "id-d"


def _event(event: str, t: float, pid: int, **fields: Any) -> dict[str, Any]:
    return {"event": event, "t": t, "pid": pid, **fields}


def clean_history() -> History:
    events = [
        _event("process_init", 0.1, 11, ppid=10), _event("process_init", 0.1, 12, ppid=10),
        _event("process_init", 0.1, 21, ppid=20),
        _event("body_start", 1.0, 11, task=JOB_TASK, task_id=A, key="job:j1", token=1),
        _event("body_start", 1.0, 12, task=JOB_TASK, task_id=C, key="job:j2", token=1),
        _event("lease_finished", 1.5, 12, task=JOB_TASK, task_id=C, key="job:j2", token=1),
        _event("result_write", 1.6, 12, task=JOB_TASK, task_id=C, state="SUCCESS", token=1),
        _event("fault", 2.0, 1, kind="kill", main_pid=10, pids=[10, 11]),  # 12 via process_init
        _event("lease_taken_over", 5.0, 21, task=JOB_TASK, task_id=A, key="job:j1", token=2),
        _event("body_start", 5.0, 21, task=JOB_TASK, task_id=A, key="job:j1", token=2),
        _event("lease_finished", 5.5, 21, task=JOB_TASK, task_id=A, key="job:j1", token=2),
        _event("result_write", 5.6, 21, task=JOB_TASK, task_id=A, state="SUCCESS", token=2),
        _event("result_write", 6.0, 21, task=JOB_TASK, task_id=C, state="SUCCESS", token=1),
        _event("callback_body", 6.1, 21, task=CALLBACK_TASK, task_id="cb-a", parent_id=A,
               root_id=A, key="cb-a", token=1),
        _event("lease_finished", 6.2, 21, task=CALLBACK_TASK, task_id="cb-a", parent_id=A,
               root_id=A, key="cb-a", token=1),
        _event("result_write", 6.3, 21, task=CALLBACK_TASK, task_id="cb-a", state="SUCCESS",
               token=1),
        # cb-c deferred itself once: its redelivery has itself as parent, the job as root.
        _event("lease_finished", 6.4, 21, task=CALLBACK_TASK, task_id="cb-c", parent_id="cb-c",
               root_id=C, key="cb-c", token=1),
        _event("result_write", 6.5, 21, task=CALLBACK_TASK, task_id="cb-c", state="SUCCESS",
               token=1),
        _event("result_write", 7.0, 21, task=JOB_TASK, task_id=D, state="FAILURE"),
    ]
    return History(
        store="doctored", ttl=2.0,
        published=[Published(A, "j1", "job:j1", "original"), Published(A, "j1", "job:j1", "resend"),
                   Published(B, "j1", "job:j1", "alias"), Published(C, "j2", "job:j2", "original"),
                   Published(D, "j3", "job:j3", "original")],
        rows={"job:j1": Row("job:j1", "done", 2, "w:21:x", None, 2, 1),
              "job:j2": Row("job:j2", "done", 1, "w:12:x", None, 1, 0),
              "job:j3": Row("job:j3", "dead", 1, "w:21:x", "effect needs reconciliation", 1, 0),
              "cb-a": Row("cb-a", "done", 1), "cb-c": Row("cb-c", "done", 1)},
        receipts={"send:j1": "done", "send:j2": "done", "send:j3": "needs_reconciliation"},
        backend={A: BackendEntry("SUCCESS", {"token": 2}), B: BackendEntry("PENDING"),
                 C: BackendEntry("SUCCESS", {"token": 1}), D: BackendEntry("FAILURE", "boom"),
                 "cb-a": BackendEntry("SUCCESS", {"token": 1}),
                 "cb-c": BackendEntry("SUCCESS", {"token": 1})},
        events=events,
        received=[{"idempotency_key": "send:j1", "token": 2, "pid": 21},
                  {"idempotency_key": "send:j2", "token": 1, "pid": 12},
                  {"idempotency_key": "send:j3", "token": 1, "pid": 21}],
        broker=[])


def test_a_clean_history_passes_every_check() -> None:
    """The baseline the defects below are made from: no violation, honest outcomes counted."""
    report = check(clean_history())
    assert report.passed, report.violations
    assert report.counts["done"] == 2
    assert report.counts["dead"] == "1 (0 by policy, 1 needs_reconciliation)"
    assert report.counts["takeovers"] == 1


def test_a_history_survives_its_json_form() -> None:
    """``history.json`` re-checks to the same verdict (``python -m benchmarks.chaos.checker``)."""
    history = clean_history()
    history.rows["job:j2"] = Row("job:j2", "ready", 1)
    again = History.from_json(history.to_json())
    assert check(again).violations == check(history).violations


def _finish(h: History, key: str, token: int, pid: int, t: float, task: str = JOB_TASK,
            **fields: Any) -> None:
    h.events.append(_event("lease_finished", t, pid, task=task, key=key, token=token, **fields))


def _row(state: str, token: int = 1) -> Callable[[History], None]:
    return lambda h: h.rows.update({"job:j2": Row("job:j2", state, token)})


def _backend(task_id: str, state: str, result: Any = None) -> Callable[[History], None]:
    return lambda h: h.backend.update({task_id: BackendEntry(state, result)})


def _callback_row_running(h: History) -> None:
    h.rows["cb-a"] = Row("cb-a", "running", 1)


def _received_then_gone(h: History) -> None:
    h.published.append(Published("id-e", "j4", "job:j4", "original"))
    h.events.append(_event("task_received", 8.0, 20, task=JOB_TASK, task_id="id-e"))


def _only_queued(h: History) -> None:
    h.published.append(Published("id-e", "j4", "job:j4", "original"))
    h.broker.append(BrokerMessage("id-e", JOB_TASK, None, None, "queue"))


def _finish_on_dead_row(h: History) -> None:
    _finish(h, "job:j3", 1, 21, 7.0)


def _second_finish(h: History) -> None:
    _finish(h, "job:j1", 1, 11, 1.5)


def _effect_twice(h: History) -> None:
    h.received.append({"idempotency_key": "send:j1", "token": 2, "pid": 21})


def _effect_missing(h: History) -> None:
    h.received = [r for r in h.received if r["idempotency_key"] != "send:j2"]


def _callback_id_twice(h: History) -> None:
    _finish(h, "cb-a", 2, 21, 8.0, CALLBACK_TASK, parent_id=A, root_id=A)


def _callback_under_two_ids(h: History) -> None:
    _finish(h, "cb-a2", 1, 21, 8.0, CALLBACK_TASK, parent_id=A, root_id=A)


def _callback_never_ran(h: History) -> None:
    # A worker received it (so the broker delivered it), and it never ran to a row.
    h.events = [e for e in h.events if e.get("root_id") != C]
    h.events.append(_event("task_received", 6.3, 20, task=CALLBACK_TASK, task_id="cb-c",
                           parent_id=C, root_id=C))
    del h.rows["cb-c"]


def _live_process_writes_twice(h: History) -> None:
    h.events.append(_event("result_write", 9.0, 21, task=JOB_TASK, task_id=A,
                           state="SUCCESS", token=2))


def _plain_callback_twice(h: History) -> None:
    for t in (6.6, 9.0):  # at-least-once by contract: counted, never failed
        h.events.append(_event("plain_callback", t, 21, task=PLAIN_CALLBACK_TASK,
                               task_id="plain-a", root_id=A))
        h.events.append(_event("result_write", t, 21, task=PLAIN_CALLBACK_TASK,
                               task_id="plain-a", state="SUCCESS"))


def test_a_plain_callback_may_run_twice() -> None:
    """Its double run and double result write are counted, not failed (no lease: Celery's
    at-least-once)."""
    history = clean_history()
    _plain_callback_twice(history)
    report = check(history)
    assert report.passed, report.violations
    assert report.counts["plain callback runs"] == "2 (1 extra: at-least-once)"


def _stopped_writer_then_redelivery(h: History) -> None:
    # pid 22 is stopped (alive, not dead), writes a FAILURE; pid 21 later writes SUCCESS.
    h.events.append(_event("process_init", 0.1, 22, ppid=20))
    h.events.append(_event("fault", 3.0, 1, kind="stop", target=22))
    h.events.append(_event("result_write", 3.5, 22, task=JOB_TASK, task_id=A, state="FAILURE"))
    h.events.sort(key=lambda e: e["t"])


def _calls(key: str, *calls: tuple[float, float, str, dict[str, Any], Any]
           ) -> Callable[[History], None]:
    """Store calls recorded as the workers record them: (invoked, completed, op, the lease's
    fields, answer); ``completed`` None: never answered; answer ``"error"``: raised."""
    def doctor(h: History) -> None:
        for n, (invoked, completed, op, fields, answer) in enumerate(calls):
            call = f"{key}-{n}"
            h.events.append(_event("store_call", invoked, 21, phase="invoke", call=call, op=op,
                                   key=key, **fields))
            if completed is not None:
                told = {"error": "StoreError"} if answer == "error" else {"answer": answer}
                h.events.append(_event("store_call", completed, 21, phase="complete",
                                       call=call, **told))
        h.events.sort(key=lambda e: e["t"])
    return doctor


W1, W2 = {"owner": "w1", "ttl": 2.0}, {"owner": "w2", "ttl": 2.0}
T1, T2 = {"owner": "w1", "token": 1}, {"owner": "w2", "token": 2}


def _unexplained_dead_reason(h: History) -> None:
    """The seed's failure: a bug in the body, and every key ends dead for it."""
    h.rows["job:j3"] = Row("job:j3", "dead", 1, "w:21:x", "failed: AttributeError('x')", 1, 0)
    h.receipts["send:j3"] = "done"


#: The calls of job:j1 in a run where nothing is wrong: a claim renewed, its holder stalled
#: past its deadline, a takeover at the deadline exactly, the stale finish refused, the new
#: holder's finish accepted (ending done with token 2, as the clean history's row says), a
#: renewal whose outcome never came back, and a finish and claim that overlap in time.
GOOD_CALLS = _calls(
    "job:j1",
    (1.0, 1.01, "claim", W1, [1, 3.0]),
    (2.0, 2.01, "renew", {**T1, "ttl": 2.0}, [1, 4.0]),
    (3.9, None, "renew", {**T1, "ttl": 2.0}, None),
    (4.0, 4.02, "claim", W2, [2, 6.0]),
    (4.01, 4.03, "finish", T1, False),
    (5.0, 5.01, "finish", T2, True),
    (5.0, 5.02, "claim", W1, None),
)


#: From a real run (PostgreSQL, 2026-12-06; times shifted): a finish with a settle phase, slow
#: to answer, whose phase a renewal pinned later extends. Only an instant inside the finish's
#: interval, before the lease ran out, explains it: the judge once tried only the ends.
SETTLE_CALLS = _calls(
    "job:j2",
    (7.531, 9.134, "claim", W1, [1, 9.552]),
    (9.134, 10.394, "renew", {**T1, "ttl": 2.0}, [1, 11.137]),
    (9.135, 11.648, "finish", {**T1, "settle_within": 2.0}, True),
    (9.635, 12.889, "renew", {**T1, "ttl": 2.0}, [1, 13.636]),
    (12.901, 12.915, "settle", T1, True),
)


#: From a real run (MySQL, CI, 2026-12-07; times shifted): the first claim's process was killed
#: before its answer came back, yet the claim took the key (token 1), so a second claim was
#: refused and a third took it over with token 2, the first token anyone was told. The judge
#: once counted tokens from the first one told, so that token 2 read as the key's first.
UNTOLD_FIRST_CALLS = _calls(
    "job:j1",
    (1.0, None, "claim", W1, None),
    (1.6, 1.61, "claim", W2, None),
    (3.6, 3.65, "claim", W2, [2, 5.6]),
    (3.7, 3.71, "finish", T2, True),
)


@pytest.mark.parametrize("calls", [GOOD_CALLS, SETTLE_CALLS, UNTOLD_FIRST_CALLS],
                         ids=["takeover", "settle", "untold-first-claim"])
def test_a_history_the_model_explains_passes(calls: Callable[[History], None]) -> None:
    history = copy.deepcopy(clean_history())
    calls(history)
    report = check(history)
    assert report.passed, report.violations


#: One defect per check, at least: (the check that must fail, how to doctor the history).
DEFECTS: dict[str, tuple[str, Callable[[History], None]]] = {
    "a job row left running": ("lost", _row("running")),
    "a job row left ready": ("lost", _row("ready")),
    "a callback row left running": ("lost", _callback_row_running),
    "no row, its message only queued": ("lost", _only_queued),
    "received by a worker, then no row and no message": ("lost", _received_then_gone),
    "two accepted finishes of one key": ("double_accepted", _second_finish),
    "an accepted token the row does not end with": ("stale_accepted", _row("done", 2)),
    "an accepted finish on a dead row": ("stale_accepted", _finish_on_dead_row),
    "the receiver got one key twice": ("duplicate_effect", _effect_twice),
    "a done job the receiver never heard of": ("missing_effect", _effect_missing),
    "one callback id accepted twice": ("callback_double_run", _callback_id_twice),
    "two callback ids for one parent": ("callback_double_run", _callback_under_two_ids),
    "SUCCESS, and its callback never ran": ("callback_lost", _callback_never_ran),
    "one live process wrote twice": ("double_result_write", _live_process_writes_twice),
    "a stopped writer, then a redelivery": ("double_result_write",
                                            _stopped_writer_then_redelivery),
    "FAILURE for a done row": ("backend_mismatch", _backend(C, "FAILURE", "x")),
    "a done row, SUCCESS nowhere": ("backend_mismatch", _backend(C, "PENDING")),
    "SUCCESS of another token": ("backend_mismatch", _backend(A, "SUCCESS", {"token": 1})),
    "SUCCESS for a dead row": ("backend_mismatch", _backend(D, "SUCCESS", {"token": 1})),
    "a dead row nobody was told about": ("backend_mismatch", _backend(D, "PENDING")),
    # The model's judge: store answers that no order of the calls explains.
    "a double accept": ("unexplained_history", _calls(
        "job:j2", (1.0, 1.01, "claim", W1, [1, 3.0]), (1.5, 1.51, "finish", T1, True),
        (1.6, 1.61, "finish", T1, True))),
    "a stale accept": ("unexplained_history", _calls(
        "job:j2", (1.0, 1.01, "claim", W1, [1, 3.0]), (3.5, 3.51, "claim", W2, [2, 5.5]),
        (4.0, 4.01, "finish", T1, True))),
    "a token regression": ("unexplained_history", _calls(
        "job:j2", (1.0, 1.01, "claim", W1, [2, 3.0]), (3.5, 3.51, "claim", W2, [1, 5.5]))),
    "a key lost": ("unexplained_history", _calls(
        "job:j9", (1.0, 1.01, "claim", W1, [1, 3.0]), (1.5, 1.51, "finish", T1, True))),
    "a renewal at the deadline": ("unexplained_history", _calls(
        "job:j2", (1.0, 1.01, "claim", W1, [1, 3.0]),
        (3.0, 3.0, "renew", {**T1, "ttl": 2.0}, [1, 5.0]))),
    "a key dead for a bug in the body": ("unexplained_dead", _unexplained_dead_reason),
}


@pytest.mark.parametrize("defect", DEFECTS)
def test_each_check_fails_on_its_defect(defect: str) -> None:
    """Every check can fail: the doctored history is caught by the check made for it."""
    name, doctor = DEFECTS[defect]
    history = copy.deepcopy(clean_history())
    doctor(history)
    report = check(history)
    assert name in report.failed_checks(), (defect, report.violations)


def test_every_check_has_a_defect_that_fails_it() -> None:
    """The transactional variants' checks have theirs in test_chaos_tx.py."""
    assert {name for name, _ in DEFECTS.values()} == set(CHECKS) - set(TX_CHECKS)


def _store_lost_its_data(h: History) -> None:
    """The store's server came back empty (no persistence): every row is gone, and the next
    delivery was refused with StoreDataLost."""
    h.rows.clear()
    h.events.append(_event("duplicate_deferred", 8.0, 21, task=JOB_TASK, task_id=D,
                           reason="the lease store failed (redis lease store at h:1/0 "
                                  "(prefix 'p:') lost its data: the epoch record x is gone)"))


def test_a_store_that_lost_its_data_and_refused_passes_what_follows_from_the_loss() -> None:
    """Rows gone with the store's data (lost, stale accepted, callbacks' rows) are reported
    apart once the store refused with StoreDataLost; without the refusal they fail the run,
    and a result accepted twice fails it even with the refusal."""
    history = clean_history()
    _store_lost_its_data(history)
    report = check(history)
    assert report.passed, report.violations
    assert report.counts["epoch refusals (StoreDataLost)"] == 1
    assert any("follow from the loss" in note for note in report.notes), report.notes

    unseen = clean_history()
    unseen.rows.clear()
    assert {"stale_accepted", "callback_lost"} <= set(check(unseen).failed_checks())

    twice = clean_history()
    _store_lost_its_data(twice)
    _second_finish(twice)
    assert "double_accepted" in check(twice).failed_checks()


def test_a_key_only_the_broker_holds_is_reported_not_failed() -> None:
    """Never claimed (no row) and held in a dead worker's unacked messages: the broker's
    promise (its visibility timeout), not the lease store's; counted as held by the broker."""
    history = clean_history()
    history.published.append(Published("id-e", "j4", "job:j4", "original"))
    history.broker.append(BrokerMessage("id-e", JOB_TASK, None, None, "unacked"))
    report = check(history)
    assert report.passed, report.violations
    assert report.counts["held by broker (dead worker's unacked)"] == 1


def test_a_key_no_worker_ever_received_is_reported_not_failed() -> None:
    """No row, no message anywhere and no ``task_received`` for any of its ids: the broker
    transport lost it before Celery saw it (not the lease store's promise)."""
    history = clean_history()
    history.published.append(Published("id-e", "j4", "job:j4", "original"))
    report = check(history)
    assert report.passed, report.violations
    assert report.counts["lost by broker (never received)"] == 1


def test_a_process_is_dead_from_its_kill_on_not_before() -> None:
    """Group kills take the pool children with them; a sweep kill names its group."""
    history = clean_history()
    history.events.append(_event("process_init", 3.0, 31, ppid=30))
    history.events.append(_event("fault", 4.0, 30, kind="sweep_kill", group=30))
    died = deaths(history)
    assert died[10] == died[11] == died[12] == 2.0
    assert died[30] == died[31] == 4.0
    assert 21 not in died


# -- the runs ----------------------------------------------------------------------------------

#: A short run per store; the harness itself bounds every phase, this is the backstop.
RUN_TIMEOUT = 240


@pytest.mark.worker
@pytest.mark.serial  # its 2 s ttl: a second test process starving this one fails a lease
@pytest.mark.timeout(RUN_TIMEOUT + 60)
@pytest.mark.parametrize(("store", "broker"), [("sqlite", "sqs"), ("postgres", "redis"),
                                               ("redis", "rabbitmq"), ("mysql", "redis")])
def test_a_short_chaos_run_passes(store: str, broker: str) -> None:
    """150 tasks, duplicates, every fault that applies to the store: the checker passes. Each
    store once, each on a broker of its own: SQS (moto's server, rows written at publish),
    Redis (new work at priority 5, recovered work at 0, rows written at publish; PostgreSQL
    and MySQL), RabbitMQ (recovered work at its queue's top priority)."""
    reachable, detail = redis_reachable()
    require("Redis", reachable, detail)
    if store == "postgres":
        reachable, detail = postgres_reachable()
        require("PostgreSQL", reachable, detail)
    if store == "mysql":
        reachable, detail = mysql_reachable()
        require("MariaDB", reachable, detail)
    if broker == "rabbitmq":
        reachable, detail = rabbitmq_reachable()
        require("RabbitMQ", reachable, detail)
    # On Redis and SQS with rows written at publish. Redis: kombu's pop-then-record window
    # loses a message now and then (a worker killed in between). SQS: a message a killed
    # worker had received stays invisible for its visibility timeout (an hour here), so no
    # claim and no row: the run ended with it "lost" (CI, seed 2256264464). The row brings
    # either back within the run instead of leaving it to the broker.
    recording = ["--record-at-publish"] if broker in ("redis", "sqs") else []
    # SQS: a callback's message (no row at publish) a killed worker had received comes back
    # after 10 s instead of after the run (callback_lost, CI seed 3680404250).
    if broker == "sqs":
        recording += ["--visibility-timeout", "10"]
    run_chaos(["--store", store, "--broker", broker, "--tasks", "150", "--faults", "all",
               "--settle", "60", *recording, "--conf", "task_default_priority=5",
               "--conf", "task_queue_max_priority=10"],
              timeout=RUN_TIMEOUT, what=f"the chaos run on {store}")


def test_fault_to_settled_counts_the_keys_each_victim_held() -> None:
    """``latency.fault_latencies``: a kill hits the keys its group's processes held (not one
    they had finished, not another worker's), a stop the keys its child held; each settles at
    its first accepted finish or death after the fault, by any process; a key whose sweep was
    killed too is counted apart, and one that never settles is counted as such."""
    from benchmarks.chaos.latency import fault_latencies, format_latency

    history = clean_history()
    history.events = [
        _event("lease_acquired", 1.0, 11, key="k1", token=1),
        _event("lease_acquired", 1.0, 12, key="k2", token=1),
        _event("lease_finished", 1.5, 12, key="k2", token=1),  # done before the kill
        _event("lease_acquired", 1.6, 12, key="k3", token=1),
        _event("lease_acquired", 1.7, 31, key="k4", token=1),  # another worker's
        _event("lease_acquired", 1.8, 32, key="k5", token=1),
        _event("fault", 2.0, 1, kind="kill", main_pid=10, pids=[10, 11, 12]),
        _event("fault", 2.5, 1, kind="stop", target=32),
        _event("fault", 4.0, 33, kind="sweep_kill", group=33, keys=["k3"], tokens=[1]),
        _event("lease_taken_over", 4.5, 21, key="k1", token=2),
        _event("lease_finished", 5.0, 21, key="k1", token=2),
        _event("lease_finished", 5.5, 31, key="k4", token=1),
        _event("lease_dead", 7.0, 21, key="k5", token=2),
        _event("lease_finished", 14.0, 21, key="k3", token=2),
    ]
    found = fault_latencies(history)
    assert {kind: (sorted(f.seconds), f.unsettled) for kind, f in found.items()} == {
        "kill": ([3.0], 0), "kill+sweep": ([12.0], 0), "stop": ([4.5], 0)}
    history.events = [e for e in history.events if e.get("key") != "k5"]
    assert "stop" not in fault_latencies(history)  # the stopped child held nothing
    history.events.insert(0, _event("lease_acquired", 1.9, 32, key="k6", token=1))
    assert format_latency(fault_latencies(history)["stop"]) == "no key, 1 never settled"
    assert format_latency(found["kill"]) == "1 keys: p50 3.0s / p95 3.0s / max 3.0s"
