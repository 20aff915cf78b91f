"""Store round trips per heartbeat interval for 1 to 1,000 held leases, aligned or staggered.

    python benchmarks/heartbeat_cost.py [--stores sqlite,postgres,redis] [--leases 1,10,100,1000]
        [--intervals 3] [--interval 1.0] [--json]

One process holds N leases of one store, watched by the real heartbeat
(``Heartbeat.for_process()``, the thread every worker process runs) through real
``Execution`` objects, with a renewal interval of 1 s and ttl 3 s (the library's default
ratio). Two start patterns:

- *aligned*: the N claims are sent back to back and share one claim instant (the moment before
  the first), as when N tasks start together: they all fall due at once;
- *staggered*: the claims are spread evenly over one interval, as tasks that start one after
  another: each falls due one interval after its own claim.

The store object's ``renew_many`` and ``renew`` are wrapped to count calls (one call, one round
trip; ``renew`` delegating to ``renew_many`` counts once) and the leases each carries. After
the claims, one interval of warm-up; then ``--intervals`` intervals are counted, in a window
that starts a quarter interval before the next renewal (the first sent a quarter interval or
more after the warm-up), so that no renewal sits on its edge. ``lost`` counts the leases whose
handle says lost at the end (a refused renewal or a missed local deadline): it must be 0.

The goal (issue 10) is at most 2 round trips per interval per store per process with 1,000
staggered leases. Nothing is asserted: the figures are printed. PostgreSQL (a schema of the
run's own, dropped after) and Redis (database 14, a key prefix of the run's own, deleted after)
on 127.0.0.1; SQLite in a temporary file with the store's defaults (``synchronous=full``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lease_celery import Store, open_store
from lease_celery.identity import process_owner
from lease_celery.runtime.execution import Execution
from lease_celery.runtime.heartbeat import Heartbeat

PG_DSN = "postgresql://127.0.0.1:5432/test"
REDIS_HOST, REDIS_PORT, REDIS_DB = "127.0.0.1", 6379, 14
STORES = ("sqlite", "postgres", "redis")
STARTS = ("aligned", "staggered")
#: ttl in heartbeat intervals: the library's default interval is ttl / 3.
TTL_INTERVALS = 3


@dataclass
class Call:
    sent_at: float  # time.monotonic() when the call started
    leases: int
    renewed: int
    failed: bool


class RoundTrips:
    """Counts the renewal calls made on one store object (wrapping its methods in place)."""

    def __init__(self, store: Store) -> None:
        self.calls: list[Call] = []
        self.in_flight = 0
        self._lock = threading.Lock()
        self._nested = threading.local()
        for name, many in (("renew_many", True), ("renew", False)):
            setattr(store, name, self._counted(getattr(store, name), many=many))

    def _counted(self, method: Callable[..., Any], *, many: bool) -> Callable[..., Any]:
        def counted(arg: Any, **kwargs: Any) -> Any:
            if getattr(self._nested, "active", False):  # renew() calling renew_many()
                return method(arg, **kwargs)
            leases, sent_at = len(arg) if many else 1, time.monotonic()
            self._nested.active = True
            with self._lock:
                self.in_flight += 1
            try:
                answer = method(arg, **kwargs)
            except BaseException:
                self._record(Call(sent_at, leases, 0, failed=True))
                raise
            finally:
                self._nested.active = False
            renewed = sum(a is not None for a in answer) if many else int(answer is not None)
            self._record(Call(sent_at, leases, renewed, failed=False))
            return answer

        return counted

    def _record(self, call: Call) -> None:
        with self._lock:
            self.in_flight -= 1
            self.calls.append(call)

    def between(self, start: float, end: float) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if start <= c.sent_at < end]

    def first_after(self, moment: float) -> float | None:
        with self._lock:
            return min((c.sent_at for c in self.calls if c.sent_at >= moment), default=None)

    def quiet(self, timeout: float) -> None:
        """Wait until no renewal is in flight (before the store is closed)."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)


@dataclass
class Row:
    store: str
    leases: int
    starts: str
    claim_seconds: float  # from the first claim sent to the last answered
    warmup_round_trips: int  # from the first claim to the counted window
    round_trips: float  # per interval, in the window
    renewed: float  # leases renewed per interval, in the window
    max_per_round_trip: int
    failed: int  # renewal calls that raised, in the whole run
    lost: int
    #: Every renewal call of the row: (seconds after the first claim, leases, renewed).
    calls: list[tuple[float, int, int]]
    window: tuple[float, float]  # the counted window, seconds after the first claim


def sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


def measure(name: str, store: Store, counter: RoundTrips, leases: int, starts: str,
            interval: float, intervals: int) -> Row:
    heartbeat, owner = Heartbeat.for_process(), process_owner()
    ttl = TTL_INTERVALS * interval
    tag = uuid.uuid4().hex[:8]
    handles: list[Execution] = []
    start = time.monotonic()
    for i in range(leases):
        if starts == "staggered":
            sleep_until(start + i * interval / leases)
        sent_at = time.monotonic() if starts == "staggered" else start
        lease = store.claim(f"hb:{tag}:{i}", owner=owner, ttl=ttl)
        if lease is None:
            raise RuntimeError(f"{name}: fresh key hb:{tag}:{i} was not claimable")
        handle = Execution(lease, store=store, ttl=ttl, heartbeat_interval=interval,
                             sent_at=sent_at)
        handles.append(handle)
        if starts == "staggered":
            heartbeat.watch(handle)  # a task starts being renewed as soon as it claims
    if starts == "aligned":
        for handle in handles:
            heartbeat.watch(handle)
    claimed = time.monotonic()
    warm_end = claimed + interval
    sleep_until(warm_end)
    # The window starts a quarter interval before the first renewal sent a quarter interval or
    # more after the warm-up (one due right at its end may be sent a little late). Renewals
    # that fall in two phases half an interval apart are then both clear of the edges.
    anchor, search_from = None, warm_end + interval / 4
    while anchor is None and time.monotonic() < search_from + 2 * interval:
        anchor = counter.first_after(search_from)
        time.sleep(0.005)
    window_start = (anchor if anchor is not None else search_from) - interval / 4
    window_end = window_start + intervals * interval
    sleep_until(window_end)
    lost = sum(handle.lost is not None for handle in handles)
    for handle in handles:
        heartbeat.unwatch(handle)  # left to expire: every row goes with the run's store
    calls = counter.between(window_start, window_end)
    return Row(store=name, leases=leases, starts=starts, claim_seconds=claimed - start,
               warmup_round_trips=len(counter.between(start, window_start)),
               round_trips=len(calls) / intervals,
               renewed=sum(c.renewed for c in calls) / intervals,
               max_per_round_trip=max((c.leases for c in calls), default=0),
               failed=sum(c.failed for c in counter.between(start, time.monotonic())),
               lost=lost, window=(window_start - start, window_end - start),
               calls=[(round(c.sent_at - start, 3), c.leases, c.renewed)
                      for c in counter.between(start, time.monotonic())])


@contextmanager
def opened(name: str, tmp: Path, run: str) -> Iterator[Store]:
    """The store ``name`` in a place of this run's own, removed afterwards."""
    schema = prefix = f"bench_hb_{run}"
    url = {"sqlite": f"sqlite:///{tmp / 'heartbeat.sqlite3'}",
           "postgres": f"{PG_DSN}?schema={schema}",
           "redis": f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}?prefix={prefix}:"}[name]
    store = open_store(url)
    try:
        yield store
    finally:
        store.close()
        if name == "postgres":
            import psycopg

            with psycopg.connect(PG_DSN, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        elif name == "redis":
            import redis

            client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=REDIS_DB)
            try:
                for key in client.scan_iter(f"{prefix}:*"):
                    client.delete(key)
            finally:
                client.close()


HEADER = (f"{'store':<10}{'leases':>7}  {'starts':<10}{'claims s':>9}{'warm-up rt':>11}"
          f"{'rt/interval':>12}{'renewed/interval':>17}{'max/rt':>7}{'lost':>6}")


def line(row: Row) -> str:
    return (f"{row.store:<10}{row.leases:>7}  {row.starts:<10}{row.claim_seconds:>9.2f}"
            f"{row.warmup_round_trips:>11}{row.round_trips:>12.2f}{row.renewed:>17,.1f}"
            f"{row.max_per_round_trip:>7}{row.lost:>6}")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--leases", default="1,10,100,1000", help="held leases, comma-separated")
    parser.add_argument("--intervals", type=int, default=3, help="intervals counted per row")
    parser.add_argument("--interval", type=float, default=1.0,
                        help=f"seconds between renewals; ttl is {TTL_INTERVALS} intervals")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    if not stores or set(stores) - set(STORES):
        parser.error(f"--stores: choose from {', '.join(STORES)}")
    counts = [int(n) for n in args.leases.split(",")]
    if not counts or min(counts) < 1 or args.intervals < 1 or args.interval <= 0:
        parser.error("need --leases >= 1, --intervals >= 1 and --interval > 0")
    run, rows, started = uuid.uuid4().hex[:8], [], time.monotonic()
    if not args.json:
        print(f"run {run}: interval {args.interval:g}s, ttl {TTL_INTERVALS * args.interval:g}s,"
              f" {args.intervals} intervals counted after 1 of warm-up", flush=True)
        print(HEADER, flush=True)
    with tempfile.TemporaryDirectory(prefix=f"lease_heartbeat_{run}_") as tmp:
        for name in stores:
            with opened(name, Path(tmp), run) as store:
                # Connect, create the schema, load the scripts: before anything is counted.
                warm = store.claim(f"hb:warm:{run}", owner=process_owner(), ttl=10.0)
                assert warm is not None and store.renew(warm, ttl=10.0) is not None
                store.release(warm)
                counter = RoundTrips(store)
                for leases in counts:
                    for starts in STARTS:
                        rows.append(measure(name, store, counter, leases, starts,
                                            args.interval, args.intervals))
                        if not args.json:
                            print(line(rows[-1]), flush=True)
                counter.quiet(timeout=5.0)
    wall = time.monotonic() - started
    if args.json:
        print(json.dumps({"interval": args.interval, "ttl": TTL_INTERVALS * args.interval,
                          "intervals": args.intervals, "rows": [asdict(r) for r in rows],
                          "wall_seconds": wall}, indent=1))
    else:
        print(f"wall time: {wall:.0f}s")
    return 1 if any(row.lost or row.failed for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
