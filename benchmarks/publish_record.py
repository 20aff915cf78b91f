"""What ``lease_record_at_publish`` costs the publisher: ``apply_async`` calls per second on a
Redis broker, with and without the row written before each message, per lease store.

Both sides publish the same task (a LeasedTask of a publisher app, fresh key each call) to a
queue of the run's own on Redis db 9, measured in alternating bursts (the order rotating every
round: benchmarks/store_cycle.alternate) so that machine noise hits them alike; the queue is
deleted at the end.

    python -m benchmarks.publish_record [--seconds 0.25] [--rounds 12] [--stores sqlite,...]

Prints publishes/s for each side and store, and the ratio recorded / plain.
"""

from __future__ import annotations

import argparse
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from benchmarks.store_cycle import PG_DSN, alternate
from lease_celery import LeasedTask

BROKER = "redis://127.0.0.1:6379/9"


def publisher(store_url: str, queue: str) -> Any:
    app = Celery(f"bench-publisher-{uuid.uuid4().hex[:6]}", broker=BROKER,
                 set_as_current=False)
    app.conf.update(task_default_queue=queue, lease_store_url=store_url,
                    task_ignore_result=True)

    @app.task(bind=True, base=LeasedTask, name="bench.publish", lease_key="bench:{n}",
              shared=False)
    def publish(self: LeasedTask, n: int) -> None:
        raise AssertionError("never run: only published")

    app.finalize()
    return publish


def side(task: Any, record: bool) -> tuple[Callable[[int], None], Callable[[], None]]:
    run = uuid.uuid4().hex[:8]

    def cycle(i: int) -> None:
        task.apply_async((f"{run}:{i}",), lease_record=record)

    return cycle, lambda: None


def measure(name: str, store_url: str, seconds: float, rounds: int) -> dict[str, Any]:
    queue = f"bench-publish-{uuid.uuid4().hex[:8]}"
    task = publisher(store_url, queue)
    try:
        mean = alternate({"plain": side(task, False), "recorded": side(task, True)},
                         seconds, rounds)
    finally:
        redis.Redis.from_url(BROKER).delete(queue)
    return {"store": name, **mean, "ratio": mean["recorded"] / mean["plain"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.25, help="per burst and side")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--stores", default="sqlite,postgres,redis")
    args = parser.parse_args()
    prefix = f"bench_publish_{uuid.uuid4().hex[:8]}:"
    with tempfile.TemporaryDirectory() as tmp:
        urls = {"sqlite": f"sqlite:///{Path(tmp) / 'bench.sqlite3'}", "postgres": PG_DSN,
                "redis": f"redis://127.0.0.1:6379/9?prefix={prefix}"}
        print(f"{'store':<10}{'plain/s':>10}{'recorded/s':>12}{'ratio':>8}")
        for name in args.stores.split(","):
            row = measure(name, urls[name], args.seconds, args.rounds)
            print(f"{name:<10}{row['plain']:>10,.0f}{row['recorded']:>12,.0f}"
                  f"{row['ratio']:>8.2f}")
    client = redis.Redis.from_url("redis://127.0.0.1:6379/9")
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)


if __name__ == "__main__":
    main()
