"""An app whose broker, task and lease settings agree: doctor finds nothing to say."""

from __future__ import annotations

import os

from celery import Celery

from lease_celery import LeasedTask

app = Celery("doctor_good", broker="redis://127.0.0.1:6379/11", set_as_current=False)
app.conf.update(
    broker_transport_options={"visibility_timeout": 3600},
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_time_limit=600,
    task_default_priority=5,  # new work in a later Redis priority list than recovered work
    lease_store_url=os.environ["DOCTOR_STORE"],
    lease_ttl=30,
)


@app.task(base=LeasedTask, bind=True, shared=False, lease_key="report:{report_id}")
def report(self: LeasedTask, report_id: int) -> int:
    return report_id
