"""Example tasks: build a report exactly once per report id, however often it is delivered."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from lease_celery import LeasedTask

from .app import app
from .settings import DATA_DIR


def _log(event: str, **fields: Any) -> None:
    """Append to the demo's run log (one JSON line per event; O_APPEND keeps lines whole)."""
    line = json.dumps({"event": event, "pid": os.getpid(), "t": time.time(), **fields}) + "\n"
    with open(os.path.join(DATA_DIR, "runs.jsonl"), "a", encoding="utf-8") as log:
        log.write(line)


@app.task(base=LeasedTask, bind=True, lease_key="report:{report_id}")
def build_report(self: LeasedTask, report_id: int, seconds: float = 1.0) -> dict[str, Any]:
    """Pretend to build report ``report_id``; the lease makes duplicates wait and drop out."""
    _log("body_start", report_id=report_id, token=self.lease.token)
    time.sleep(seconds)
    self.lease.check()  # stop here if another worker has taken the report over
    _log("body_end", report_id=report_id, token=self.lease.token)
    return {"report_id": report_id, "token": self.lease.token, "built_by": os.getpid()}
