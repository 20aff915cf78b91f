"""A stalled owner behind a backlog: how many queued tasks start before its key runs again.

The scene of issue 21's recovery figures, on one real worker (``-c 2``, ttl 2 s): a LeasedTask
runs in one pool process, which is SIGSTOPped; ``BACKLOG`` short tasks of other keys are
queued behind it at ``NEW_WORK_PRIORITY`` and run one by one in the other pool process. The
stopped owner's lease expires, the worker's sweeper re-publishes its task, and the queue order
decides when it runs again: at the tail, after the whole backlog; as recovered work, next.
"""

from __future__ import annotations

import os
import signal
import uuid
from dataclasses import dataclass

from tests.support.workers import WorkerPool

WORK = "tests.support.worker_app.work"
#: Tasks queued behind the stalled owner, and each one's body (seconds).
BACKLOG, BACKLOG_BODY = 40, 0.25
#: What new work is published at: a later Redis priority list than recovery's (0), and below
#: RabbitMQ's x-max-priority (10).
NEW_WORK_PRIORITY = 5


@dataclass(frozen=True)
class Recovery:
    started_before: int  # backlog tasks that started before the stalled key ran again
    seconds: float  # from the stop to the key's second start
    token: int  # the second start's token


def stalled_owner_behind_a_backlog(workers: WorkerPool) -> Recovery:
    workers.start("a", concurrency=2)
    job = uuid.uuid4().hex[:10]
    send = workers.client.send_task
    # By name, so the priority is given here (send_task does not apply task_default_priority).
    send(WORK, args=(job, 3.0), priority=NEW_WORK_PRIORITY)
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                             what="the owner to start")
    first = workers.journal.events("body_start", job_id=job)[0]
    os.kill(first["pid"], signal.SIGSTOP)
    try:
        backlog = [f"backlog-{job}-{n}" for n in range(BACKLOG)]
        for other in backlog:
            send(WORK, args=(other, BACKLOG_BODY), priority=NEW_WORK_PRIORITY)
        workers.journal.wait_for(
            lambda j: len(j.events("body_start", job_id=job)) > 1,
            timeout=BACKLOG * BACKLOG_BODY * 3 + 30, what="the stalled owner's key to run again")
    finally:
        os.kill(first["pid"], signal.SIGCONT)
    again = workers.journal.events("body_start", job_id=job)[1]
    started = [e for e in workers.journal.events("body_start")
               if str(e["job_id"]).startswith(f"backlog-{job}-") and e["t"] < again["t"]]
    workers.journal.wait_for(lambda j: bool(j.events("body_end", job_id=job)), timeout=20,
                             what="the recovered run to end")
    stopped_at = first["t"]  # the stop came right after the owner's start
    return Recovery(len(started), again["t"] - stopped_at, int(again["token"]))
