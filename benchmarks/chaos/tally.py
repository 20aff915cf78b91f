"""The numbers of a run, in the order the table prints them (pure, like the checker)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from .config import CALLBACK_TASK, JOB_TASK, PLAIN_CALLBACK_TASK, effect_key
from .history import History

__all__ = ["tally"]


def _count(history: History, name: str, task: str | None = None) -> int:
    return sum(1 for e in history.events
               if e.get("event") == name and (task is None or e.get("task") == task))


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
        "wall time": f"{history.wall_time:.1f}s",
    }
    return counts
