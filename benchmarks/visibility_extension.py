"""What ``lease_extend_visibility`` saves: redeliveries of one long task under a short SQS
visibility timeout, with and without it.

Two real workers (``-c 1`` each, tests/support/worker_app.py) on a moto SQS server
(benchmarks/sqs_server.py), Redis results, a SQLite store, ttl 2 s. One LeasedTask runs
``--seconds`` (60) under a ``--visibility`` (10 s) timeout: without the extension SQS hands its
message to the other worker every timeout while it runs, and each copy is deferred by the lease
and re-published; with it, the worker extends the message's visibility while the lease is
renewed. Then the owner's pool process is SIGSTOPped in a second run with the extension on: its
message must still come back (once its lease has expired and one more timeout passed).

    python -m benchmarks.visibility_extension [--seconds 60] [--visibility 10]

Prints, per variant: receipts of the task's message, deferred copies, body runs, and seconds
from the stop to the redelivery.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from benchmarks.sqs_server import broker_url, sqs_client, sqs_port, transport_options
from tests.support.workers import Journal, WorkerPool

REDIS = "redis://127.0.0.1:6379/9"
WORK = "tests.support.worker_app.work"


def _pool(tmp: Path, port: int, visibility: float, extend: bool) -> tuple[WorkerPool, Celery]:
    run = uuid.uuid4().hex[:8]
    env = {"LEASE_TEST_BROKER": broker_url(port), "LEASE_TEST_RESULT_BACKEND": REDIS,
           "LEASE_TEST_JOURNAL_REDIS": REDIS, "LEASE_TEST_QUEUE": f"bench-visibility-{run}",
           "LEASE_TEST_JOURNAL": f"bench-visibility-{run}",
           "LEASE_TEST_STORE": f"sqlite:///{tmp / f'{run}.sqlite3'}",
           "LEASE_TEST_TTL": "2", "LEASE_TEST_HEARTBEAT": "0.5",
           "LEASE_TEST_VISIBILITY": str(visibility), "LEASE_TEST_SWEEP_INTERVAL": "0"}
    if extend:
        env["LEASE_TEST_EXTEND_VISIBILITY"] = "1"
    pool = WorkerPool(tmp=tmp, env=env, journal=Journal(redis.Redis.from_url(REDIS),
                                                       env["LEASE_TEST_JOURNAL"]))
    client = Celery("bench-visibility", broker=env["LEASE_TEST_BROKER"], backend=REDIS,
                    set_as_current=False)
    client.conf.task_default_queue = env["LEASE_TEST_QUEUE"]
    client.conf.broker_transport_options = transport_options(visibility)
    return pool, client


def run(tmp: Path, port: int, *, seconds: float, visibility: float, extend: bool,
        stall: bool) -> dict[str, Any]:
    pool, client = _pool(tmp, port, visibility, extend)
    try:
        pool.start("a", concurrency=1)
        pool.start("b", concurrency=1)
        job, task_id = uuid.uuid4().hex[:10], str(uuid.uuid4())
        result = client.send_task(WORK, args=(job, seconds), task_id=task_id)
        back_after = None
        if stall:
            pool.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)),
                                  timeout=30, what="the owner to start")
            owner = pool.journal.events("body_start", job_id=job)[0]
            os.kill(owner["pid"], signal.SIGSTOP)
            stopped = time.time()
            try:
                pool.journal.wait_for(
                    lambda j: len(j.events("task_received", task_id=task_id)) > 1,
                    timeout=4 * visibility + 30, what="the stalled task's message to come back")
            finally:
                os.kill(owner["pid"], signal.SIGCONT)
            back_after = pool.journal.events("task_received", task_id=task_id)[1]["t"] - stopped
        result.get(timeout=seconds * 3 + 60)
        time.sleep(min(visibility, 5.0))  # a copy still in flight is counted too
        journal = pool.journal
        return {"receipts": len(journal.events("task_received", task_id=task_id)),
                "deferred": len(journal.events("duplicate_deferred", key=f"job:{job}")),
                "runs": len(journal.events("body_start", job_id=job)),
                "back_after": back_after}
    finally:
        pool.stop_all()
        client.close()
        server = sqs_client(port)
        for url in server.list_queues(QueueNamePrefix=pool.env["LEASE_TEST_QUEUE"]).get(
                "QueueUrls", []):
            server.delete_queue(QueueUrl=url)
        redis.Redis.from_url(REDIS).delete(pool.env["LEASE_TEST_JOURNAL"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.visibility_extension")
    parser.add_argument("--seconds", type=float, default=60.0, help="the task's body")
    parser.add_argument("--visibility", type=float, default=10.0, help="SQS visibility timeout")
    args = parser.parse_args(argv)
    port, why = sqs_port()
    if port is None:
        raise SystemExit(f"no SQS server: {why}")
    print(f"one task of {args.seconds:g}s, visibility timeout {args.visibility:g}s, ttl 2s, "
          "two workers -c 1 on SQS (moto)")
    print("| variant | receipts | deferred copies | body runs | stop to redelivery |")
    print("| --- | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory(prefix="bench-visibility-") as tmp:
        for name, extend, stall in (("plain", False, False), ("extended", True, False),
                                    ("extended, owner stalled", True, True)):
            row = run(Path(tmp), port, seconds=args.seconds, visibility=args.visibility,
                      extend=extend, stall=stall)
            back = "" if row["back_after"] is None else f"{row['back_after']:.1f}s"
            print(f"| {name} | {row['receipts']} | {row['deferred']} | {row['runs']} | {back} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
