"""An app with several misconfigurations at once, and a lease store that cannot be reached
(PostgreSQL on a closed port of 127.0.0.1)."""

from __future__ import annotations

from celery import Celery

from lease_celery import LeasedTask

app = Celery("doctor_bad", broker="redis://127.0.0.1:6379/11", set_as_current=False)
app.conf.update(
    broker_transport_options={"visibility_timeout": 20},
    task_acks_late=False,
    worker_prefetch_multiplier=8,
    worker_deduplicate_successful_tasks=True,
    lease_store_url="postgresql://127.0.0.1:1/test?connect_timeout=2",
    lease_ttl=30,
    lease_heartbeat_interval=25,
)


@app.task(base=LeasedTask, bind=True, shared=False, lease_key="report:{report_id}",
          time_limit=900)
def report(self: LeasedTask, report_id: int) -> int:
    return report_id
