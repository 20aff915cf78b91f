"""Two checks that judge a run by what explains it, not by a list of known failures:

``unexplained_history``
    Each key's store calls, as the workers recorded them (:mod:`benchmarks.chaos.calls`),
    must be explained by the reference model: some order of them, each at an instant of its
    own interval, gives every answer the store gave and ends the key as the store did
    (:mod:`benchmarks.chaos.linearizable`). A double accept, a stale accept, a token that
    went back and a key the store lost are all answers no order explains. The detail is the
    smallest such history.
``unexplained_dead``
    A key that ended ``dead`` is dead for a reason the run's faults explain: the takeovers or
    attempts its reason counts (as many as the row or the event log shows), an effect whose
    outcome became unknown, or an error a fault raises (a lost lease, a store that could not
    answer, a killed pool process, a time limit). Anything else, an ``AttributeError`` in the
    body for one, is a violation: a run whose every key ends dead for a bug passes no check.
"""

from __future__ import annotations

import re
from collections import Counter

from .config import effect_key
from .history import History
from .linearizable import calls_by_key, smallest_unexplained

__all__ = ["FAULT_ERRORS", "unexplained_dead", "unexplained_history"]

Finding = tuple[str, str, str]  # (check, subject, detail): the checker makes it a Violation

#: Errors the injected faults raise in a body or its ending (their names in a dead reason).
FAULT_ERRORS = ("LeaseLost", "LeaseCancelled", "StaleFence", "StoreError", "StoreBusy",
                "StoreDataLost", "EffectOutcomeUnknown", "WorkerLostError",
                "TimeLimitExceeded", "SoftTimeLimitExceeded", "Terminated")


def unexplained_history(history: History) -> list[Finding]:
    lost_data = any(e.get("event") == "store_call" and e.get("error") == "StoreDataLost"
                    for e in history.events)
    findings = []
    for key, calls in sorted(calls_by_key(history.events).items()):
        row = history.rows.get(key)
        # A store that lost its data loses rows outside any call: the end is not judged.
        end = None if lost_data else ((row.state, row.token) if row else ("missing", 0))
        smallest = smallest_unexplained(calls, end)
        if smallest is not None:
            told = "; ".join(call.describe() for call in smallest)
            ends = "" if end is None or len(smallest) < len(calls) else f"; the key ends {end}"
            findings.append(("unexplained_history", key,
                             f"no order of these {len(smallest)} calls explains them: "
                             f"{told}{ends}"))
    return findings


def unexplained_dead(history: History) -> list[Finding]:
    takeovers = Counter(str(e.get("key")) for e in history.events
                        if e.get("event") == "lease_taken_over")
    claims = Counter(str(e.get("key")) for e in history.events
                     if e.get("event") in ("lease_acquired", "lease_taken_over"))
    findings = []
    for key, row in sorted(history.rows.items()):
        if row.state != "dead":
            continue
        reason = row.reason or ""
        job = key.removeprefix("job:")
        lost = re.search(r"was lost (\d+) times", reason)
        exhausted = re.search(r"(\d+) attempts exhausted", reason)
        if lost:
            explained = max(takeovers[key], row.takeovers) >= int(lost.group(1))
        elif exhausted:
            explained = max(claims[key], row.attempts) >= int(exhausted.group(1))
        else:
            explained = ("reconciliation" in reason
                         or history.receipts.get(effect_key(job)) == "needs_reconciliation"
                         or any(name in reason for name in FAULT_ERRORS))
        if not explained:
            findings.append(("unexplained_dead", key,
                             f"dead for {reason!r}, which the run's faults do not explain "
                             f"(takeovers {max(takeovers[key], row.takeovers)}, attempts "
                             f"{max(claims[key], row.attempts)})"))
    return findings
