"""The business logic: building a report. Knows nothing about Celery or leases."""

from __future__ import annotations

import random
import time
from typing import Any

__all__ = ["Report", "build_report", "publish_key"]

#: A report as it is published: JSON, and the same for every build of one (edition, id), so a
#: second publish of it is recognisably a duplicate rather than a different report.
Report = dict[str, Any]


def build_report(edition: str, report_id: int, *, seconds: float) -> Report:
    """Pretend to do the expensive part (queries, aggregation, rendering) for ``seconds``."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.05))
    figures = random.Random(f"{edition}:{report_id}")
    return {
        "edition": edition,
        "report_id": report_id,
        "title": f"Report {report_id} ({edition})",
        "rows": [{"region": region, "sales": figures.randint(100, 999)}
                 for region in ("north", "south", "east", "west")],
    }


def publish_key(report: Report) -> str:
    """The stable business key of publishing ``report``: the same however often it is retried.

    Not the lease token, which changes on every takeover (see DESIGN.md, effects).
    """
    return f"publish:report:{report['edition']}:{report['report_id']}:v1"
