"""The Celery app the chaos workers run: ``celery -A benchmarks.chaos.app worker``.

Configured from the environment the harness sets (:mod:`benchmarks.chaos.config`). The task
under test is ``chaos.job``: a LeasedTask keyed ``job:{job}`` that sleeps a little in slices
checking its lease, then sends ONE outside effect to the receiver through ``self.effect`` and
returns a small JSON result carrying its lease token. Its ``link`` callbacks are a LeasedTask
keyed by its own task id (``chaos.on_done``) and a plain task (``chaos.on_done_plain``). In the
transactional variants (``app-tx``, ``enqueue-tx``) the body then inserts an app row and
completes the key in one transaction of the app's own connection (:mod:`.apptx`); in
``django-tx`` the job is a ``LeasedDjangoTask`` that writes Django models and completes the key
in one ``self.lease.atomic()`` block (:mod:`.djangotx`). What
happens is recorded in the event log by the tasks and by :mod:`benchmarks.chaos.hooks`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery import Celery

from lease_celery import LeasedTask

from . import hooks, receiver
from .appdb import AppDatabase
from .apptx import complete_in_app
from .config import (
    APP_DB_VARIANTS,
    CALLBACK_TASK,
    DJANGO_VARIANT,
    JOB_TASK,
    PLAIN_CALLBACK_TASK,
    ChaosConfig,
    effect_key,
)
from .djangotx import complete_in_django, setup_django
from .djangotx import job_base as django_job_base
from .events import EventLog
from .flags import Flags

__all__ = ["app", "job", "on_done", "on_done_plain"]

#: Seconds between ``lease.check()`` calls while the job body sleeps.
CHECK_SLICE = 0.05

config = ChaosConfig.from_env(os.environ)
events = EventLog(config.backend_url, config.events_key)
flags = Flags(Path(config.flags_dir))
#: The app's own tables (the transactional variants), in the store's database.
app_db = AppDatabase.of(config.store_url) if config.variant in APP_DB_VARIANTS else None
django_tx = config.variant == DJANGO_VARIANT
job_base: type[Any] = LeasedTask
if django_tx:
    setup_django()  # before the Celery app is made: its Django fix-up is chosen then
    job_base = django_job_base()

app = Celery("chaos")
app.conf.update(config.celery_conf())
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    worker_enable_remote_control=False,  # no pidbox keys or connections outside the prefix
    lease_store_url=config.store_url,
    lease_ttl=config.ttl,
    lease_heartbeat_interval=config.heartbeat,
    lease_sweep_interval=config.sweep_interval,
    lease_sweep_grace=config.sweep_grace,  # (ignored by library versions without it)
    lease_max_attempts=config.max_attempts,
    lease_max_takeovers=config.max_takeovers,
)
app.conf.update(config.extra_conf)


# (celery ships no type information: its decorators are untyped)
@app.task(base=job_base, bind=True, name=JOB_TASK, lease_key="job:{job}")  # type: ignore[untyped-decorator]
def job(self: LeasedTask, job: str, sleep_ms: int) -> dict[str, Any]:
    lease = self.lease
    token, owner, task_id = lease.token, lease.owner, self.request.id
    events.record("body_start", task=JOB_TASK, task_id=task_id, key=lease.key, token=token,
                  owner=owner)
    deadline = time.monotonic() + sleep_ms / 1000
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(CHECK_SLICE, left))
        lease.check()
    payload = {"job": job}

    def send(idempotency_key: str) -> dict[str, Any]:
        return receiver.send(config.receiver_url, {
            "idempotency_key": idempotency_key, "payload": payload, "token": token,
            "pid": os.getpid(), "owner": owner, "task_id": task_id})

    sent = self.effect(effect_key(job), payload, send)
    # As a careful body does before it returns: stop if the lease is known lost. (Under slow
    # store replies the heartbeat's own deadline can pass while the store still holds the
    # lease: exactly the seam where a local LeaseLost must not lose the key.)
    lease.check()
    events.record("body_end", task=JOB_TASK, task_id=task_id, key=lease.key, token=token)
    result = {"job": job, "token": token, "pid": os.getpid(), "receipt": sent.get("id")}
    if app_db is not None:
        # The app row and the finish commit together (the variant's point).
        return complete_in_app(self, app_db, job, result, events=events, flags=flags)
    if django_tx:
        return complete_in_django(self, job, result, events=events, flags=flags)
    return result


@app.task(base=LeasedTask, bind=True, name=CALLBACK_TASK)  # type: ignore[untyped-decorator]
def on_done(self: LeasedTask, result: Any) -> dict[str, Any]:
    """The LeasedTask callback: its key is its own task id, so it runs once per id."""
    events.record("callback_body", task=CALLBACK_TASK, task_id=self.request.id,
                  parent_id=self.request.parent_id, root_id=self.request.root_id,
                  key=self.lease.key, token=self.lease.token,
                  parent_token=result.get("token") if isinstance(result, dict) else None)
    return {"parent_id": self.request.parent_id, "token": self.lease.token}


@app.task(bind=True, name=PLAIN_CALLBACK_TASK)  # type: ignore[untyped-decorator]
def on_done_plain(self: Any, result: Any) -> None:
    """The plain callback: at-least-once, as Celery gives it."""
    events.record("plain_callback", task=PLAIN_CALLBACK_TASK, task_id=self.request.id,
                  parent_id=self.request.parent_id, root_id=self.request.root_id)


hooks.install(config, events, flags)
