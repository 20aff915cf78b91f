"""From one mode's facts to the numbers in the table.

Each number has one source, named in ``ROWS``: the timeline (what the workers did), the
outside service's own record (what it received), and the place results are written (the
plain task's table, the lease store).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from lease_celery import LeaseState, open_store

from ..receiver import Received
from ..report_table import writes
from .history import History

__all__ = ["ROWS", "Results", "Tally", "deliveries_killed", "leased_results", "plain_results",
           "tally"]

#: (attribute, label, where the number comes from), in table order.
ROWS = [
    ("tasks", "tasks (reports)", "the scenario"),
    ("deliveries", "deliveries published", "the scenario: scenes 1 and 3 publish each report "
                                            "twice, scene 2 once"),
    ("body_executions", "body executions", "timeline: body_start events"),
    ("accepted_results", "accepted results", "plain: writes to the reports table; "
                                             "leased: fenced finishes the lease store accepted"),
    ("duplicate_effects", "duplicate outside effects", "the outside service's own record"),
    ("stale_accepted", "stale writes accepted", "plain: writes over a newer build; "
                                                "leased: accepted results of a superseded token"),
    ("stale_refused", "stale writes refused", "timeline: stale_result_rejected"),
    ("lost", "tasks lost", "reports with no accepted result when the demo ends"),
]


@dataclass(frozen=True)
class Results:
    """Where a mode's results were written: how many writes, how many stale, which reports."""

    accepted: int
    stale: int
    reports: frozenset[int]


@dataclass
class Tally:
    mode: str
    title: str
    tasks: int
    deliveries: int
    body_executions: int
    accepted_results: int
    duplicate_effects: int
    stale_accepted: int
    stale_refused: int
    lost: int
    effects: int
    deferred: int
    ignored: int
    swept: int
    broker_redeliveries: int
    deliveries_killed: int
    lost_reports: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def plain_results(reports_db: str, edition: str) -> Results:
    rows = writes(reports_db, edition)
    return Results(accepted=len(rows), stale=sum(r["overwrote_newer"] for r in rows),
                   reports=frozenset(r["report_id"] for r in rows))


def leased_results(store_url: str, edition: str, report_ids: list[int],
                   history: History) -> Results:
    """One accepted result per key at most (``done`` is terminal); stale = not the last token."""
    newest = Counter[int]()
    for span in history.leases:
        newest[span.report_id] = max(newest[span.report_id], span.token)
    done: set[int] = set()
    stale = 0
    with open_store(store_url) as store:
        for report_id in report_ids:
            record = store.get(f"report:{edition}:{report_id}")
            if record is not None and record.state is LeaseState.DONE:
                done.add(report_id)
                stale += record.token < newest[report_id]
    return Results(accepted=len(done), stale=stale, reports=frozenset(done))


def tally(*, mode: str, title: str, history: History, report_ids: list[int],
          received: list[Received], results: Results) -> Tally:
    per_report = Counter(r["key"] for r in received)
    lost = sorted(set(report_ids) - results.reports)
    return Tally(
        mode=mode, title=title, tasks=len(report_ids),
        deliveries=len(history.of("published")),
        body_executions=len(history.executions),
        accepted_results=results.accepted,
        duplicate_effects=sum(n - 1 for n in per_report.values()),
        stale_accepted=results.stale,
        stale_refused=len(history.of("stale_result_rejected")),
        lost=len(lost), lost_reports=lost,
        effects=len(received),
        deferred=len(history.of("duplicate_deferred")),
        ignored=len(history.of("duplicate_ignored")),
        swept=len(history.of("lease_swept")),
        broker_redeliveries=len([e for e in history.of("received") if e.get("redelivered")]),
        deliveries_killed=deliveries_killed(history),
    )


def deliveries_killed(history: History) -> int:
    """Deliveries a SIGKILLed worker had taken off the broker and not finished.

    Whether they come back is the broker's business (RabbitMQ: at once; filesystem: never).
    """
    killed = {e.get("worker") for e in history.of("worker_killed")}
    return sum(len(history.of("received", worker=w)) - len(history.of("postrun", worker=w))
               for w in killed)
