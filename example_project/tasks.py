"""Build a report, then publish it to an outside service: the same job written twice.

``publish_report_plain`` is a plain ``celery.Task``; ``publish_report`` is a ``LeasedTask``
whose lease key comes from the business arguments, so every delivery of one report, however
it came about, competes for one lease. The ``timeline.record`` calls are the demo's
instrumentation, not part of the pattern.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Task

from lease_celery import LeasedTask

from . import outside, timeline
from .app import app
from .report_table import save_report
from .reports import Report, build_report, publish_key

__all__ = ["publish_report", "publish_report_plain"]


@app.task(bind=True)
def publish_report_plain(self: Task, edition: str, report_id: int) -> dict[str, Any]:
    """Nothing stops a second delivery, and nothing stops a stale one from writing last."""
    started_at = time.time()
    _trace("body_start", self, report_id)
    report = build_report(edition, report_id, seconds=self.app.conf.report_build_seconds)
    status = outside.publish(self.app.conf.reports_endpoint, report)
    _trace("effect_sent", self, report_id, status=status)
    overwrote_newer = save_report(self.app.conf.reports_db, report, built_by=_me(self),
                                  started_at=started_at)
    _trace("result_written", self, report_id, overwrote_newer=overwrote_newer)
    return {"report": report, "built_by": _me(self)}


@app.task(base=LeasedTask, bind=True, lease_key="report:{edition}:{report_id}")
def publish_report(self: LeasedTask, edition: str, report_id: int) -> dict[str, Any]:
    """One accepted result per report: duplicates wait for the lease, stale results are refused.

    The return value is the result; LeasedTask stores it in the lease store only if this
    execution still holds the lease (state, owner, token and deadline checked in the same
    statement as the write).
    """
    lease = self.lease
    _trace("body_start", self, report_id, token=lease.token)
    report = build_report(edition, report_id, seconds=self.app.conf.report_build_seconds)
    # Right before the outside call, make sure this execution still holds the lease. A worker
    # that stalled past it (GC pause, swapped out, SIGSTOP) raises LeaseLost here instead of
    # publishing a report that another worker has taken over (self.effect checks it too).
    lease.check()
    _publish_once(self, report)
    return {"report": report, "built_by": _me(self), "token": lease.token}


def _publish_once(task: LeasedTask, report: Report) -> None:
    """The one place the leased task touches the outside world, through a receipt.

    ``self.effect`` records the publish under a business key that is stable across retries and
    takeovers (``publish:report:<edition>:<id>:v1``, never the lease token): a replay returns
    the recorded outcome instead of publishing again, the same key with another payload is an
    error, and an attempt whose outcome is unknown asks for reconciliation instead of resending.
    """
    def send(key: str) -> int:
        status = outside.publish(task.app.conf.reports_endpoint, report)
        _trace("effect_sent", task, report["report_id"], status=status, effect_key=key)
        return status

    task.effect(publish_key(report), report, send)


def _me(task: Task) -> str:
    return f"{task.request.hostname} pid {os.getpid()}"


def _trace(event: str, task: Task, report_id: int, **fields: Any) -> None:
    timeline.record(event, task=task.name, task_id=task.request.id, report_id=report_id,
                    worker=task.request.hostname, **fields)
