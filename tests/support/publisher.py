"""A publisher of the workers' ``work`` task (tests/support/worker_app.py), as a producer's own
app defines it: the same LeasedTask on the workers' broker, queue and lease store. Used in the
test process and, run as a script, in publisher processes of their own
(tests/workers/test_record_at_publish.py)::

    python -m tests.support.publisher BROKER QUEUE STORE TASK_ID JOB [--die-before-publish]
        [--unique] [--at EPOCH]

prints the id ``apply_async(..., lease_record=True)`` returned; ``--die-before-publish``
SIGKILLs the process once the row is written, as the message is about to go to the broker.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
import uuid
from typing import Any

from celery import Celery

from lease_celery import LeasedTask

NAME = "tests.support.worker_app.work"


def publisher(broker: str, queue: str, store_url: str, *, backend: str | None = None) -> Any:
    """The ``work`` task of a publisher app of its own (its body runs in the workers only);
    results on ``backend`` (default: the broker, a Redis one)."""
    app = Celery(f"publisher-{uuid.uuid4().hex[:6]}", broker=broker, backend=backend or broker,
                 set_as_current=False)
    app.conf.update(task_default_queue=queue, lease_store_url=store_url)

    @app.task(bind=True, base=LeasedTask, name=NAME, lease_key="job:{job_id}", shared=False)
    def work(self: LeasedTask, job_id: str, seconds: float = 0.0,
             check_every: float = 0.1) -> None:
        raise AssertionError("runs in the workers only")

    app.finalize()
    return work


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("broker", "queue", "store", "task_id", "job"):
        parser.add_argument(name)
    parser.add_argument("--die-before-publish", action="store_true")
    parser.add_argument("--unique", action="store_true")
    parser.add_argument("--at", type=float, default=0.0)
    options = parser.parse_args()
    task = publisher(options.broker, options.queue, options.store)
    if options.die_before_publish:
        from celery.app import amqp

        def die(*args: Any, **kwargs: Any) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        amqp.AMQP.send_task_message = die  # type: ignore[method-assign]
    time.sleep(max(0.0, options.at - time.time()))
    result = task.apply_async((options.job, 0.2), task_id=options.task_id or None,
                              lease_record=True, lease_unique=options.unique)
    print(result.id, flush=True)


if __name__ == "__main__":
    main()
