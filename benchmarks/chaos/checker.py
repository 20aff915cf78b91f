"""The verdict on a run: pure functions from a :class:`~benchmarks.chaos.history.History` to a
:class:`Report` (no I/O, so a doctored history tests each check in milliseconds).

The checks (each is a promise of README.md / DESIGN.md §1, §6):

``lost``
    Every job key ends ``done`` or ``dead``, and so does every other row (the callbacks'): no
    orphan. Two exceptions, for keys without any row (no delivery ever claimed them), reported
    and not failed because only the broker had them: *held by broker*, a message of the key
    sits in the unacked hash where a dead worker left it (the broker hands it out again after
    its ``visibility_timeout``); *lost by broker*, no worker's consumer ever received any of
    the key's messages (no ``task_received``) and the broker holds none: a worker popped it
    (Redis ``BRPOP`` is destructive) and died before kombu recorded it as unacked.
``double_accepted``
    At most one accepted finish (``lease_finished``) per key.
``stale_accepted``
    Every accepted finish carries the row's final token, and the row is ``done``.
``duplicate_effect``
    The receiver got at most one request per idempotency key.
``missing_effect``
    A ``done`` job's effect reached the receiver (its receipt says it did).
``callback_double_run``
    The LeasedTask callback was accepted at most once per callback task id, and under at most
    one callback task id per parent task id (callbacks sent twice with fresh ids defeat the
    callback's lease: DESIGN.md §6 wants stable ids).
``callback_lost``
    A task id whose SUCCESS is in the result backend had its LeasedTask callback run (its row
    ``done``/``dead``), or the callback's message is the broker's (held or lost, as for
    ``lost``).
``double_result_write``
    A LeasedTask's outcome (the backend's ``mark_as_done`` / ``mark_as_failure``; the job and
    the LeasedTask callback, not the plain callback, which is at-least-once) was written at most
    once per task id while its first writer was alive. The rule for "alive": the first writer's
    pid had not been killed before the second write, as the event log says: a ``kill`` fault
    (its group's pids), a ``sweep_kill`` (its group: the main pid and the pool children whose
    ``process_init`` named it as parent), a ``finish_exit`` (that pid), or a ``worker_exit`` the
    supervisor noticed. Fault events are recorded before the kill, so a process is never judged
    dead while it could still write; a SIGSTOPped process is alive.
``backend_mismatch``
    The result backend tells the row's story: a ``done`` row has SUCCESS with the row's token
    for at least one of its task ids, and no FAILURE; a ``dead`` row has a FAILURE and no
    SUCCESS (an alias id may stay PENDING: its delivery was dropped as a duplicate).

And, in the transactional variants, the app's own tables (``txchecks.py``): ``app_rows``,
``stale_app_row``, ``rolled_back_ran``, ``order_mismatch``.

Dead keys (by policy, or because an effect needs reconciliation) are honest outcomes: counted,
never failed. Body runs are at-least-once by design (a worker killed after its body ran re-runs
it), so the checks count *accepted* outcomes, not body runs.
"""

from __future__ import annotations

import math
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import CALLBACK_TASK, JOB_TASK, effect_key
from .events import Event
from .history import History, Row
from .judge import unexplained_dead, unexplained_history
from .tally import tally
from .txchecks import TX_CHECKS, VARIANT_CHECKS, tx_counts, tx_violations

__all__ = ["CHECKS", "Report", "Violation", "check", "main"]

CHECKS = {
    "lost": "a key not done/dead at the end",
    "double_accepted": "two accepted finishes for one key",
    "stale_accepted": "an accepted finish whose token is not the row's final token",
    "duplicate_effect": "two requests with one idempotency key at the receiver",
    "missing_effect": "a done job whose effect never reached the receiver",
    "callback_double_run": "a LeasedTask callback accepted twice for one parent or id",
    "callback_lost": "a task with SUCCESS whose LeasedTask callback never ran",
    "double_result_write": "a result written twice while its first writer was alive",
    "backend_mismatch": "the result backend contradicts the lease row",
    "unexplained_history": "store answers no order of the calls explains (the model's judge)",
    "unexplained_dead": "a key dead for a reason the faults do not explain",
    **TX_CHECKS,
}
TERMINAL = ("done", "dead")
#: What a store that lost its data (a Redis restarted without persistence) causes by itself:
#: rows, receipts and callbacks' rows are gone. Once the store refused with StoreDataLost (its
#: epoch), these findings follow from the loss and are reported apart; every other check
#: still fails the run, because the epoch exists so that a loss never leads to them.
FOLLOW_FROM_LOSS = ("lost", "stale_accepted", "missing_effect", "callback_lost")
#: The words of StoreDataLost in a deferral's reason (lease_celery.stores.redis).
DATA_LOST = "lost its data"


@dataclass(frozen=True)
class Violation:
    check: str
    subject: str
    detail: str


@dataclass
class Report:
    store: str
    counts: dict[str, Any] = field(default_factory=dict)
    violations: list[Violation] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.violations

    def failed_checks(self) -> dict[str, int]:
        found = Counter(v.check for v in self.violations)
        return {name: found[name] for name in CHECKS if found[name]}


def check(history: History) -> Report:
    report = Report(store=history.store, notes=list(history.notes))
    broker = BrokerOutcomes()
    report.violations += _lost(history, broker)
    report.violations += _double_accepted(history)
    report.violations += _stale_accepted(history)
    report.violations += _duplicate_effect(history)
    report.violations += _missing_effect(history)
    report.violations += _callback_double_run(history)
    report.violations += _callback_lost(history, broker)
    report.violations += _double_result_write(history)
    report.violations += _backend_mismatch(history)
    report.violations += [Violation(*found) for found in unexplained_history(history)]
    report.violations += [Violation(*found) for found in unexplained_dead(history)]
    report.violations += [Violation(*found) for found in tx_violations(history)]
    refusals = epoch_refusals(history)
    after_loss = [v for v in report.violations if refusals and v.check in FOLLOW_FROM_LOSS]
    if after_loss:
        report.violations = [v for v in report.violations if v not in after_loss]
        shown = Counter(v.check for v in after_loss)
        report.notes.append(
            f"the store lost its data and refused every write after it ({refusals} deliveries "
            "deferred with StoreDataLost): "
            + ", ".join(f"{name} {shown[name]}" for name in FOLLOW_FROM_LOSS if shown[name])
            + " follow from the loss and do not fail the run; the checks a loss must not "
            "lead to (a result accepted twice, an effect sent twice, ...) still do")
    failed = report.failed_checks()
    judged = [name for name in CHECKS
              if name not in TX_CHECKS or name in VARIANT_CHECKS.get(history.variant, ())]
    report.counts = tally(history, {name: failed.get(name, 0) for name in judged},
                          held=len(broker.held), vanished=len(broker.vanished))
    report.counts["epoch refusals (StoreDataLost)"] = refusals
    report.counts.update(tx_counts(history))
    return report


def epoch_refusals(history: History) -> int:
    """Deliveries deferred because the store refused with StoreDataLost."""
    return sum(1 for e in history.events if e.get("event") == "duplicate_deferred"
               and DATA_LOST in str(e.get("reason") or ""))


# -- helpers -----------------------------------------------------------------------------------


def _events(history: History, name: str, task: str | None = None) -> list[Event]:
    return [e for e in history.events
            if e.get("event") == name and (task is None or e.get("task") == task)]


def _job_ids(history: History) -> dict[str, list[str]]:
    """Job key -> its published task ids (originals first, each once)."""
    ids: dict[str, list[str]] = defaultdict(list)
    for p in sorted(history.published, key=lambda p: p.kind != "original"):
        if p.task_id not in ids[p.key]:
            ids[p.key].append(p.task_id)
    return dict(ids)


def _unacked(history: History) -> set[str]:
    return {m.task_id for m in history.broker if m.where == "unacked"}


def _describe(row: Row | None) -> str:
    if row is None:
        return "no row"
    return (f"row {row.state} token {row.token} attempts {row.attempts} takeovers "
            f"{row.takeovers} reason {row.reason!r}")


def _parent(event: Event) -> str:
    """The job task id a callback event belongs to: its root id (a callback that re-published
    itself has itself as parent, but keeps the root), else its parent id."""
    return str(event.get("root_id") or event.get("parent_id") or "")


def _token(result: Any) -> Any:
    return result.get("token") if isinstance(result, dict) else None


def _last_events(history: History, count: int = 4) -> dict[str, str]:
    """Key -> its last few events (what happened to it last), for a violation's detail."""
    by_key: dict[str, list[str]] = defaultdict(list)
    for event in history.events:
        for key in [event.get("key"), *(event.get("keys") or [])]:
            if key:
                name = event["event"] if event["event"] != "fault" else f"fault:{event['kind']}"
                by_key[str(key)].append(f"{name}@{event.get('pid')}")
    return defaultdict(str, {k: ", ".join(v[-count:]) for k, v in by_key.items()})


def _when(event: Event) -> str:
    return f"pid {event.get('pid')} t={event.get('t', 0):.3f}"


# -- the checks --------------------------------------------------------------------------------


@dataclass
class BrokerOutcomes:
    """Keys whose fate is the broker's, not the lease store's (reported, never failed)."""

    held: list[str] = field(default_factory=list)  # in a dead worker's unacked messages
    vanished: list[str] = field(default_factory=list)  # never reached any worker's consumer


def _lost(history: History, broker: BrokerOutcomes) -> list[Violation]:
    found = []
    unacked = _unacked(history)
    received = {str(e.get("task_id")) for e in _events(history, "task_received")}
    where = defaultdict(list)
    for message in history.broker:
        where[message.task_id].append(message.where)
    jobs = _job_ids(history)
    last = _last_events(history)
    for key, ids in sorted(jobs.items()):
        row = history.rows.get(key)
        if row is not None and row.state in TERMINAL:
            continue
        if row is None and any(i in unacked for i in ids):
            broker.held.append(key)
            continue
        if row is None and not any(where[i] or i in received for i in ids):
            # Popped by a worker that died before kombu recorded it as unacked (BRPOP is
            # destructive): no worker's consumer ever had it, so no lease ever could.
            broker.vanished.append(key)
            continue
        messages = {i: where[i] for i in ids if where[i]}
        found.append(Violation("lost", key, f"{_describe(row)}; broker holds "
                               f"{messages or 'nothing'}; last events: {last[key]}"))
    for key, row in sorted(history.rows.items()):
        if key not in jobs and row.state not in TERMINAL:
            found.append(Violation("lost", key, f"{_describe(row)} (a callback); last events: "
                                   f"{last[key]}"))
    return found


def _finished(history: History) -> dict[str, list[Event]]:
    by_key: dict[str, list[Event]] = defaultdict(list)
    for event in _events(history, "lease_finished"):
        by_key[str(event.get("key"))].append(event)
    return by_key


def _double_accepted(history: History) -> list[Violation]:
    return [Violation("double_accepted", key,
                      "accepted finishes: " + "; ".join(
                          f"token {e.get('token')} task {e.get('task_id')} {_when(e)}"
                          for e in finishes))
            for key, finishes in sorted(_finished(history).items()) if len(finishes) > 1]


def _stale_accepted(history: History) -> list[Violation]:
    found = []
    for key, finishes in sorted(_finished(history).items()):
        row = history.rows.get(key)
        for event in finishes:
            if row is None or row.state != "done" or row.token != event.get("token"):
                found.append(Violation(
                    "stale_accepted", key,
                    f"finish of token {event.get('token')} accepted ({_when(event)}) but the "
                    f"row ends as: {_describe(row)}"))
    return found


def _duplicate_effect(history: History) -> list[Violation]:
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for request in history.received:
        by_key[str(request["idempotency_key"])].append(request)
    return [Violation("duplicate_effect", key, f"{len(requests)} requests: " + "; ".join(
        f"token {r.get('token')} pid {r.get('pid')} task {r.get('task_id')}" for r in requests))
        for key, requests in sorted(by_key.items()) if len(requests) > 1]


def _missing_effect(history: History) -> list[Violation]:
    received = {str(r["idempotency_key"]) for r in history.received}
    found = []
    for job in sorted({p.job for p in history.published}):
        row = history.rows.get(f"job:{job}")
        if row is not None and row.state == "done" and effect_key(job) not in received:
            found.append(Violation("missing_effect", f"job:{job}",
                                   f"done (token {row.token}), receipt "
                                   f"{history.receipts.get(effect_key(job))!r}, and the "
                                   f"receiver never got {effect_key(job)!r}"))
    return found


def _callback_double_run(history: History) -> list[Violation]:
    found = []
    finishes = _events(history, "lease_finished", CALLBACK_TASK)
    per_id = Counter(str(e.get("key")) for e in finishes)
    for callback_id, count in sorted(per_id.items()):
        if count > 1:
            found.append(Violation("callback_double_run", callback_id,
                                   f"callback task id accepted {count} times"))
    per_parent: dict[str, set[str]] = defaultdict(set)
    for event in finishes:
        per_parent[_parent(event)].add(str(event.get("key")))
    for parent, callbacks in sorted(per_parent.items()):
        if len(callbacks) > 1:
            found.append(Violation("callback_double_run", parent,
                                   f"LeasedTask callback accepted under {len(callbacks)} "
                                   f"callback ids: {sorted(callbacks)}"))
    return found


def _callback_lost(history: History, broker: BrokerOutcomes) -> list[Violation]:
    if not history.linked:
        return []  # published without callbacks
    callbacks: dict[str, set[str]] = defaultdict(set)  # parent id -> callback ids seen
    for event in history.events:
        if event.get("task") == CALLBACK_TASK and _parent(event):
            callbacks[_parent(event)].add(str(event.get("task_id") or event.get("key")))
    in_broker: dict[str, set[str]] = defaultdict(set)  # parent id -> where its callbacks are
    for message in history.broker:
        if message.task == CALLBACK_TASK:
            in_broker[str(message.root_id or message.parent_id)].add(message.where)
    found = []
    for task_id in sorted({p.task_id for p in history.published}):
        entry = history.backend.get(task_id)
        if entry is None or entry.state != "SUCCESS":
            continue
        rows = [history.rows.get(c) for c in callbacks.get(task_id, ())]
        if any(r is not None and r.state in TERMINAL for r in rows):
            continue
        if not any(rows) and "unacked" in in_broker[task_id]:
            broker.held.append(f"callback of {task_id}")
            continue
        if not callbacks.get(task_id) and not in_broker[task_id]:
            broker.vanished.append(f"callback of {task_id}")  # as for ``lost``
            continue
        found.append(Violation("callback_lost", task_id,
                               f"SUCCESS in the result backend; LeasedTask callback ids seen "
                               f"{sorted(callbacks.get(task_id, ())) or 'none'}, rows "
                               f"{[_describe(r) for r in rows] or 'none'}, broker holds "
                               f"{sorted(in_broker[task_id]) or 'nothing'}"))
    return found


def deaths(history: History) -> dict[int, float]:
    """pid -> the earliest time the event log says it was killed (see ``double_result_write``)."""
    children: dict[int, set[int]] = defaultdict(set)
    for event in _events(history, "process_init"):
        children[int(event["ppid"])].add(int(event["pid"]))
    died: dict[int, float] = {}

    def dead(pids: set[int] | list[int], t: float) -> None:
        for pid in pids:
            died[int(pid)] = min(died.get(int(pid), math.inf), t)

    for event in history.events:
        kind, t = event.get("kind"), float(event.get("t", 0.0))
        if event.get("event") == "fault" and kind == "kill":
            main = int(event["main_pid"])
            dead({main, *event.get("pids", []), *children[main]}, t)
        elif event.get("event") == "fault" and kind == "sweep_kill":
            group = int(event.get("group") or event["pid"])
            dead({group, *children[group]}, t)
        elif event.get("event") == "fault" and kind in ("finish_exit", "commit_exit"):
            dead([int(event["pid"])], t)
        elif event.get("event") == "worker_exit":
            main = int(event["main_pid"])
            dead({main, *children[main]}, t)
    return died


def _double_result_write(history: History) -> list[Violation]:
    died = deaths(history)
    writes: dict[str, list[Event]] = defaultdict(list)
    for event in _events(history, "result_write"):
        # Lease-protected tasks only: a plain task (the plain callback) is at-least-once by
        # contract, each of its deliveries runs and writes (its extra runs are counted).
        if event.get("task_id") and event.get("task") in (JOB_TASK, CALLBACK_TASK):
            writes[str(event["task_id"])].append(event)
    found = []
    for task_id, events in sorted(writes.items()):
        events.sort(key=lambda e: float(e.get("t", 0.0)))
        pair = next(((first, second) for j, second in enumerate(events) for first in events[:j]
                     if died.get(int(first["pid"]), math.inf) > float(second["t"])), None)
        if pair is not None:
            first, second = pair
            found.append(Violation(
                "double_result_write", task_id,
                f"{first.get('task')}: {first.get('state')} by {_when(first)}, then "
                f"{second.get('state')} by {_when(second)} while the first writer was alive"))
    return found


def _backend_mismatch(history: History) -> list[Violation]:
    stories: dict[str, list[str]] = dict(_job_ids(history))
    for callback_id in {str(e["key"]) for e in _events(history, "lease_finished", CALLBACK_TASK)}:
        stories.setdefault(callback_id, [callback_id])
    found = []
    for key, ids in sorted(stories.items()):
        row = history.rows.get(key)
        if row is None or row.state not in TERMINAL:
            continue  # "lost" speaks for it
        entries = {i: e for i in ids if (e := history.backend.get(i)) is not None}
        seen = {i: entries[i].state if i in entries else "unread" for i in ids}
        successes = [i for i, e in entries.items() if e.state == "SUCCESS"]
        failures = [i for i, e in entries.items() if e.state == "FAILURE"]
        problem = None
        if row.state == "done":
            wrong = [i for i in successes if _token(entries[i].result) != row.token]
            if not successes:
                problem = "no task id has SUCCESS"
            elif wrong:
                problem = f"SUCCESS with another token for {wrong}"
            elif failures:
                problem = f"FAILURE for {failures}"
        elif successes:
            problem = f"SUCCESS for {successes}"
        elif not failures:
            problem = "no task id has FAILURE"
        if problem is not None:
            found.append(Violation("backend_mismatch", key,
                                   f"{_describe(row)}, but {problem}: {seen}"))
    return found


def main(argv: list[str] | None = None) -> int:
    """Check a saved history again: ``python -m benchmarks.chaos.checker history.json``."""
    from .report import format_report

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m benchmarks.chaos.checker HISTORY.json", file=sys.stderr)
        return 2
    report = check(History.from_json(Path(args[0]).read_text()))
    print(format_report(report))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
