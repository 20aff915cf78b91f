"""The numbers of a run, in the order the table prints them (pure, like the checker)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from .config import CALLBACK_TASK, JOB_TASK, PLAIN_CALLBACK_TASK, effect_key
from .history import History
from .latency import fault_latencies, format_latency

__all__ = ["tally"]


def _count(history: History, name: str, task: str | None = None) -> int:
    return sum(1 for e in history.events
               if e.get("event") == name and (task is None or e.get("task") == task))


#: How a deferral for an unavailable store begins its reason (lease_celery's LeasedTask).
STORE_DEFERRALS = {"claim": "the lease store failed", "finish": "finish failed in the lease store"}


def _store_deferrals(history: History) -> list[tuple[str, float]]:
    """(``claim`` or ``finish``, time) of every deferral for an unavailable store."""
    found = []
    for event in history.events:
        if event.get("event") != "duplicate_deferred":
            continue
        reason = str(event.get("reason") or "")
        for step, start in STORE_DEFERRALS.items():
            if reason.startswith(start):
                found.append((step, float(event.get("t", 0.0))))
    return found


def _outages(history: History, deferrals: list[tuple[str, float]]) -> str:
    """Each store restart: how long the server did not answer, and how many deliveries were
    deferred for it (from the restart until two ttls after the server answered again: a
    delivery waits about one before it is deferred)."""
    starts = [e for e in history.events
              if e.get("event") == "fault" and e.get("kind") == "store-restart"]
    ends = [e for e in history.events
            if e.get("event") == "fault_end" and e.get("kind") == "store-restart"]
    if not starts:
        return "none"
    shown = []
    for start in starts:
        begun = float(start.get("t", 0.0))
        end = next((e for e in ends if float(e.get("t", 0.0)) >= begun), None)
        if end is not None:
            ends.remove(end)
        until = (float(end["t"]) if end is not None else begun) + 2 * history.ttl
        deferred = sum(1 for _, t in deferrals if begun <= t <= until)
        seconds = ("unfinished" if end is None else "failed" if "seconds" not in end
                   else f"{float(end['seconds']):.1f}s")
        shown.append(f"{seconds}: {deferred}")
    return f"{len(starts)} ({', '.join(shown)})"


def _unexpected_exits(history: History) -> int:
    """Worker main processes that exited while no fault had killed them."""
    killed = set()
    for event in history.events:
        if event.get("event") == "fault" and event.get("kind") == "kill":
            killed.add(int(event["main_pid"]))
        elif event.get("event") == "fault" and event.get("kind") == "sweep_kill":
            killed.add(int(event.get("group") or event["pid"]))
    return sum(1 for e in history.events
               if e.get("event") == "worker_exit" and int(e["main_pid"]) not in killed)


def _hung(history: History) -> int:
    return sum(len(e.get("hung") or []) for e in history.events
               if e.get("event") == "workers_stopped")


def tally(history: History, checks: dict[str, int], *, held: int,
          vanished: int) -> dict[str, Any]:
    """Table rows: what was published and injected, what ran, each check's violations, and
    the honest outcomes (dead keys, receipts needing reconciliation, the broker's keys)."""
    kinds = Counter(p.kind for p in history.published)
    faults = Counter(str(e.get("kind")) for e in history.events if e.get("event") == "fault")
    armed: Counter[str] = Counter()
    for event in history.events:
        if event.get("event") == "fault_armed":
            armed[str(event.get("kind"))] += int(event.get("tickets", 1))
    plain = [str(e.get("task_id")) for e in history.events
             if e.get("event") == "plain_callback" and e.get("task") == PLAIN_CALLBACK_TASK]
    jobs = {p.key for p in history.published}
    job_rows = [history.rows[k] for k in jobs if k in history.rows]
    dead = [r for r in job_rows if r.state == "dead"]
    reconcile = {k for k, state in history.receipts.items() if state == "needs_reconciliation"}
    dead_reconcile = [r for r in dead if effect_key(r.key.removeprefix("job:")) in reconcile]
    for_store = _store_deferrals(history)
    by_step = Counter(step for step, _ in for_store)
    counts: dict[str, Any] = {
        "tasks": kinds["original"],
        "duplicates published": f"{kinds['resend'] + kinds['alias']} "
                                f"({kinds['resend']} same id, {kinds['alias']} new id)",
        "faults injected": ", ".join(f"{k} {n}" for k, n in sorted(faults.items())) or "none",
        "faults armed (tickets)": ", ".join(f"{k} {n}" for k, n in sorted(armed.items()))
                                  or "none",
        "body runs": _count(history, "body_start", JOB_TASK),
        "callback body runs": _count(history, "callback_body", CALLBACK_TASK),
        "plain callback runs": f"{len(plain)} ({len(plain) - len(set(plain))} extra: "
                               "at-least-once)",
        "claims": _count(history, "lease_acquired"),
        "takeovers": _count(history, "lease_taken_over"),
        "re-publishes (sweeper)": _count(history, "lease_swept"),
        "deferred duplicates": _count(history, "duplicate_deferred"),
        "deferred for the store (claim, finish)": f"{len(for_store)} ({by_step['claim']}, "
                                                  f"{by_step['finish']})",
        "store restarts (down: deferred)": _outages(history, for_store),
        "ignored duplicates": _count(history, "duplicate_ignored"),
        "stale results rejected": _count(history, "stale_result_rejected"),
        "leases lost (local)": _count(history, "lease_lost"),
        "effect requests received": len(history.received),
        **checks,
        "done": sum(r.state == "done" for r in job_rows),
        "dead": f"{len(dead)} ({len(dead) - len(dead_reconcile)} by policy, "
                f"{len(dead_reconcile)} needs_reconciliation)",
        "needs_reconciliation receipts": len(reconcile),
        "held by broker (dead worker's unacked)": held,
        "lost by broker (never received)": vanished,
        "worker exits without a fault": _unexpected_exits(history),
        "workers hung at stop (SIGKILLed)": _hung(history),
    }
    latencies = fault_latencies(history)
    if latencies:
        counts["fault to settled, goal at p95"] = f"{3 * history.ttl:g}s (3 x ttl)"
    for kind, latency in latencies.items():
        counts[f"fault to settled, {kind}"] = format_latency(latency)
    counts["wall time"] = f"{history.wall_time:.1f}s"
    return counts
