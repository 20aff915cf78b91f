"""The faults: which exist, how many a run gets and when, and the thread that injects them.

| switch | what happens |
| --- | --- |
| ``kill`` | SIGKILL a whole worker (its process group); the supervisor starts a fresh one |
| ``stop`` | SIGSTOP one pool child for 1.5–2 × ttl, then SIGCONT (a stall past the lease) |
| ``conn`` | kill the lease store's connections from the server side (PostgreSQL, Redis,
  MySQL) |
| ``slow`` | delay the store's replies by 0.6–0.9 × ttl for 2–3 × ttl (PostgreSQL, Redis, MySQL) |
| ``sweep`` | arm a ticket right before each ``kill`` (else twice): the next worker whose sweep
  marks rows SIGKILLs its own group between the mark and the re-publish |
| ``finish`` | arm tickets: a pool child exits between its accepted finish and the result write |
| ``hold`` | arm tickets: a pool child stalls 1.25 × ttl between its accepted finish and the result
  write while its own message is delivered again (a redelivery racing the result write) |
| ``store-restart`` | restart the store's server (opt-in, never in ``all``): the machine's
  PostgreSQL (``pg_ctlcluster ... restart -m fast``), the machine's MariaDB (``mariadb-admin
  shutdown``, then started as ``.ci/run`` starts it), or the run's own redis-server, down for
  0.25–1 × ttl (two restarts in three) or 1.5–2.5 × ttl (longer than a delivery waits) |
| ``commit`` | (``app-tx``, ``enqueue-tx``, ``django-tx``) arm tickets: a pool child exits right
  after its app transaction (Django: its ``self.lease.atomic()`` block) committed the key's
  finish, before Celery stores the result or acks |
| ``publisher`` | (``enqueue-tx``) arm tickets: a publisher process exits right after its
  transaction committed, before it publishes the message (the sweeper publishes from the row) |
| ``purge`` | (``enqueue-tx``) stop the worker main processes (the consumers) for 1.5 s, then
  purge the broker's queue (Redis) and continue them: the rows bring the work back |

Counts are bounded (they grow with the window, up to a cap) and every fault lies inside the
window; stopped processes are always continued and slow replies switched off, also when the run
is aborted. Each injection is recorded in the event log as a ``fault`` event *before* it takes
effect (so a process is never judged alive after it was killed).
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .events import EventLog
from .flags import Flags
from .sandbox import StoreSandbox
from .workers import Worker, WorkerPool, pool_children

__all__ = ["FAULTS", "VARIANT_FAULTS", "FaultInjector", "PlannedFault", "parse_faults",
           "plan_faults"]

FAULTS = ("kill", "stop", "conn", "slow", "sweep", "finish", "hold")
#: Faults that ``all`` leaves out: each must be named (``--faults all,store-restart``).
#: ``store-restart`` on PostgreSQL restarts the machine's cluster, ending every other session
#: on it (another test run's too).
OPT_IN = ("store-restart",)
#: Faults of a variant's own seams, in its ``all``.
VARIANT_FAULTS = {"plain": (), "app-tx": ("commit",),
                  "enqueue-tx": ("commit", "publisher", "purge"), "django-tx": ("commit",)}
#: Faults that need a connection to a server (a SQLite store is a file).
SERVER_FAULTS = ("conn", "slow", "store-restart")
#: Probability that an accepted finish takes an armed ``finish_exit`` (or ``finish_hold``)
#: ticket.
FINISH_EXIT_PROBABILITY = 0.15
#: Probability that a publisher's commit takes an armed ``publisher_exit`` ticket.
PUBLISHER_EXIT_PROBABILITY = 0.25
#: Seconds the worker main processes stop consuming before the queue is purged.
PURGE_PAUSE = 1.5


def parse_faults(text: str, store: str,
                 variant: str = "plain") -> tuple[list[str], list[str]]:
    """``all``, ``none`` or a comma list (which may hold ``all``: ``all,store-restart``) →
    (enabled faults, notes on the ones skipped). ``all`` holds the variant's own faults."""
    own = VARIANT_FAULTS[variant]
    parts = [part.strip() for part in text.strip().lower().split(",") if part.strip()]
    wanted: list[str] = []
    for part in parts:
        for name in FAULTS + own if part == "all" else [] if part == "none" else [part]:
            if name not in wanted:
                wanted.append(name)
    unknown = [name for name in wanted if name not in FAULTS + OPT_IN + own]
    if unknown:
        raise ValueError(f"unknown fault(s) {', '.join(unknown)} for the {variant} variant; "
                         f"known: {', '.join(FAULTS + OPT_IN + own)}")
    skipped = []
    if store == "sqlite":
        for name in SERVER_FAULTS:
            if name in wanted:
                wanted.remove(name)
                skipped.append(f"{name}: not applicable to SQLite (a file: no server to "
                               "restart, no connection to kill, no replies to delay)")
    return wanted, skipped


@dataclass(frozen=True)
class PlannedFault:
    at: float  # seconds after the start of the window
    kind: str


def _count(window: float, per: float, low: int, high: int) -> int:
    return max(low, min(high, round(window / per)))


def plan_faults(kinds: list[str], window: float, rng: random.Random) -> list[PlannedFault]:
    plan: list[PlannedFault] = []
    # At least two of each even in a short run, so one unlucky timing (a kill of an idle
    # worker, a slow spell between tasks) does not leave a seam untested.
    counts = {"kill": _count(window, 20, 2, 4), "stop": _count(window, 20, 2, 4),
              "conn": _count(window, 8, 3, 8), "slow": _count(window, 25, 2, 3)}
    for kind, count in counts.items():
        if kind in kinds:
            plan += [PlannedFault(rng.uniform(0.1, 0.9) * window, kind) for _ in range(count)]
    if "store-restart" in kinds:
        # Spread over the window (one per slice): a restart never starts while the last one
        # is still under way, and every stretch of the run sees one.
        count = _count(window, 10, 2, 6)
        plan += [PlannedFault((0.1 + 0.8 * (i + rng.uniform(0.2, 0.8)) / count) * window,
                              "store-restart") for i in range(count)]
    if "sweep" in kinds:
        # A sweep marks rows only after some lease expired: arm it just before a kill (whose
        # rows nobody but the sweeper brings back; a stopped owner re-publishes its own when it
        # wakes up), or before a stop when there are no kills.
        hosts = ([f.at for f in plan if f.kind == "kill"]
                 or [f.at for f in plan if f.kind == "stop"])
        for at in hosts or [rng.uniform(0.1, 0.9) * window for _ in range(2)]:
            plan.append(PlannedFault(max(at - 0.05, 0.0), "sweep"))
    if "finish" in kinds:
        plan.append(PlannedFault(0.1 * window, "finish"))
    if "hold" in kinds:
        plan.append(PlannedFault(0.2 * window, "hold"))
    if "commit" in kinds:
        plan.append(PlannedFault(0.15 * window, "commit"))
    if "publisher" in kinds:
        plan.append(PlannedFault(0.1 * window, "publisher"))
    if "purge" in kinds:
        # Twice, at a third and two thirds: each while publishers and workers are busy.
        plan += [PlannedFault(window / 3, "purge"), PlannedFault(2 * window / 3, "purge")]
    return sorted(plan, key=lambda f: f.at)


class FaultInjector:
    """Injects a plan from one thread; undo steps (SIGCONT, replies back to normal) are
    scheduled, never slept on, so faults keep their times."""

    def __init__(self, plan: list[PlannedFault], *, window: float, pool: WorkerPool,
                 sandbox: StoreSandbox, flags: Flags, events: EventLog, rng: random.Random,
                 ttl: float, finish_tickets: int, broker: Any = None) -> None:
        self.plan, self.window = plan, window
        self.broker = broker  # the run's BrokerSandbox (``purge``)
        self.pool, self.sandbox, self.flags, self.events = pool, sandbox, flags, events
        self.rng, self.ttl, self.finish_tickets = rng, ttl, finish_tickets
        self.errors: list[str] = []
        self._undo: list[tuple[float, str, Callable[[], None]]] = []
        self._stopped: set[int] = set()  # pool children we SIGSTOPped and not yet continued
        self._slow_until = 0.0
        self._store: Any = None  # the lease store, read directly (opened in the fault thread)
        # A store restart runs on a thread of its own (it takes seconds: undo steps and the
        # other faults keep their times); set while one is under way.
        self._restarting = threading.Event()
        self._restart_lock = threading.Lock()
        self._restarts: list[threading.Thread] = []
        self._undo_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-faults", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop injecting and undo whatever is pending (bounded); wait for a store restart
        under way (it starts the server again whatever happens)."""
        self._stop.set()
        self._thread.join(30)
        for restart in self._restarts:
            restart.join(150)
        self._undo_all()

    def done(self) -> bool:
        return not self._thread.is_alive()

    # -- the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        start = time.monotonic()
        pending = list(self.plan)
        # Tickets not taken are withdrawn a little after the window: a sweep ticket armed for
        # a late kill needs that kill's leases to expire (a ttl) and a sweep to find them.
        self._later(start + self.window + 3 * self.ttl, "disarm", self._disarm)
        try:
            while not self._stop.is_set() and (pending or self._undo):
                now = time.monotonic()
                with self._undo_lock:
                    due = [u for u in self._undo if u[0] <= now]
                    for entry in due:
                        self._undo.remove(entry)
                for _, what, step in due:
                    self._safely(what, step)
                if pending and start + pending[0].at <= now:
                    fault = pending.pop(0)
                    self._safely(fault.kind, functools.partial(self._inject, fault.kind))
                self._stop.wait(0.05)
        finally:
            self._undo_all()
            if self._store is not None:
                self._store.close()

    def _safely(self, what: str, step: Callable[[], None]) -> None:
        try:
            step()
        except Exception as exc:  # one failed fault must not end the others (or the run)
            self.errors.append(f"{what}: {exc!r}")

    def _later(self, due: float, what: str, step: Callable[[], None]) -> None:
        with self._undo_lock:
            self._undo.append((due, what, step))

    def _undo_all(self) -> None:
        # Both the fault thread (ending) and stop() (maybe after a join timed out) get here.
        with self._undo_lock:
            while self._undo:
                _, what, step = self._undo.pop(0)
                self._safely(what, step)
            # Whatever happened above: nothing stays stopped, no reply stays slow.
            for child in list(self._stopped):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGCONT)
                self._stopped.discard(child)
            if self.sandbox.proxy is not None:
                self.sandbox.proxy.delay = 0.0

    # -- the faults -------------------------------------------------------------------------

    def _inject(self, kind: str) -> None:
        getattr(self, f"_inject_{kind.replace('-', '_')}")()

    def _busy_pids(self) -> set[int]:
        """Pids of the processes holding a running lease now (from the owners: host:pid:uuid).

        Faults aim at busy processes: killing or stopping an idle one tests nothing. While the
        store's server restarts nobody can say: any process then."""
        from lease_celery import LeaseState, StoreError, open_store

        if self._store is None:
            self._store = open_store(self.sandbox.checker_url)
        pids = set()
        try:
            running = self._store.find(state=LeaseState.RUNNING, limit=10_000)
        except StoreError:
            return set()
        for record in running:
            with contextlib.suppress(IndexError, ValueError, AttributeError):
                pids.add(int(str(record.owner).split(":")[-2]))
        return pids

    def _choose_worker(self) -> Worker | None:
        busy = self._busy_pids()
        live = self.pool.live()
        loaded = [w for w in live if busy & set(w.group_pids())]
        return self.rng.choice(loaded or live) if live else None

    def _inject_kill(self) -> None:
        worker = self._choose_worker()
        if worker is None:
            return
        self.events.record("fault", kind="kill", source="harness", worker=worker.name,
                           main_pid=worker.pid, pids=worker.group_pids())
        worker.kill()  # the supervisor replaces it

    def _inject_stop(self) -> None:
        worker = self._choose_worker()
        children = pool_children(worker.pid) if worker is not None else []
        if worker is None or not children:
            return
        busy = self._busy_pids()
        child = self.rng.choice([c for c in children if c in busy] or children)
        seconds = self.rng.uniform(1.5, 2.0) * self.ttl
        self.events.record("fault", kind="stop", source="harness", worker=worker.name,
                           target=child, seconds=round(seconds, 2))
        self._stopped.add(child)
        os.kill(child, signal.SIGSTOP)

        def resume() -> None:
            with contextlib.suppress(ProcessLookupError):  # its worker was killed meanwhile
                os.kill(child, signal.SIGCONT)
            self._stopped.discard(child)
            self.events.record("fault_end", kind="stop", target=child)

        self._later(time.monotonic() + seconds, "stop: SIGCONT", resume)

    def _inject_conn(self) -> None:
        if self._restarting.is_set():
            return  # the restart ends every connection anyway, and the server may be down
        # Recorded after the fact, with the count of what it ended (no process dies of it).
        killed = self.sandbox.kill_connections()
        self.events.record("fault", kind="conn", source="harness", killed=killed)

    def _inject_slow(self) -> None:
        proxy = self.sandbox.proxy
        if proxy is None:
            return
        delay = self.rng.uniform(0.6, 0.9) * self.ttl
        seconds = self.rng.uniform(2.0, 3.0) * self.ttl
        self.events.record("fault", kind="slow", source="harness", delay=round(delay, 3),
                           seconds=round(seconds, 2))
        proxy.delay = delay
        # A second slow fault inside the first moves the end: only the last end applies.
        self._slow_until = max(self._slow_until, time.monotonic() + seconds)

        def normal() -> None:
            if time.monotonic() >= self._slow_until - 0.01:
                proxy.delay = 0.0
                self.events.record("fault_end", kind="slow")

        self._later(time.monotonic() + seconds, "slow: normal replies", normal)

    def _inject_store_restart(self) -> None:
        if not self.sandbox.restartable:
            return
        # Two in three are a blip a delivery should wait out (shorter than a ttl); the rest
        # last longer than a delivery waits (about a ttl), so the deferral after the bound is
        # exercised too. A PostgreSQL restart takes what it takes.
        short = self.rng.random() < 2 / 3
        down = self.ttl * (self.rng.uniform(0.25, 1.0) if short else self.rng.uniform(1.5, 2.5))

        def restart() -> None:
            # One restart at a time: a restart planned while the last one is still under way
            # follows it (recorded when it begins).
            with self._restart_lock:
                self._restarting.set()
                try:
                    self._restart(down)
                finally:
                    self._restarting.clear()

        thread = threading.Thread(target=restart, name="chaos-store-restart", daemon=True)
        self._restarts.append(thread)
        thread.start()

    def _restart(self, down: float) -> None:
        own = self.sandbox.own_redis
        server = (f"redis :{own.port}" if own is not None
                  else f"{self.sandbox.kind} (the machine's server)")
        self.events.record("fault", kind="store-restart", source="harness", server=server,
                           down=round(down, 2) if own is not None else None)
        try:
            seconds = self.sandbox.restart_server(down)
        except Exception as exc:
            self.errors.append(f"store-restart: {exc!r}")
            self.events.record("fault_end", kind="store-restart", error=repr(exc)[:300])
            return
        self.events.record("fault_end", kind="store-restart", seconds=round(seconds, 3))

    def _inject_sweep(self) -> None:
        self.flags.arm("sweep_kill", count=1)
        self.events.record("fault_armed", kind="sweep_kill", tickets=1)

    def _inject_finish(self) -> None:
        self.flags.arm("finish_exit", count=self.finish_tickets,
                       probability=FINISH_EXIT_PROBABILITY)
        self.events.record("fault_armed", kind="finish_exit", tickets=self.finish_tickets,
                           probability=FINISH_EXIT_PROBABILITY)

    def _inject_hold(self) -> None:
        self.flags.arm("finish_hold", count=self.finish_tickets,
                       probability=FINISH_EXIT_PROBABILITY)
        self.events.record("fault_armed", kind="finish_hold", tickets=self.finish_tickets,
                           probability=FINISH_EXIT_PROBABILITY)

    def _inject_commit(self) -> None:
        self.flags.arm("commit_exit", count=self.finish_tickets,
                       probability=FINISH_EXIT_PROBABILITY)
        self.events.record("fault_armed", kind="commit_exit", tickets=self.finish_tickets,
                           probability=FINISH_EXIT_PROBABILITY)

    def _inject_publisher(self) -> None:
        self.flags.arm("publisher_exit", count=self.finish_tickets,
                       probability=PUBLISHER_EXIT_PROBABILITY)
        self.events.record("fault_armed", kind="publisher_exit", tickets=self.finish_tickets,
                           probability=PUBLISHER_EXIT_PROBABILITY)

    def _inject_purge(self) -> None:
        # Idle workers wait in BRPOP, and Redis hands a pushed message straight to one: the
        # list only holds messages nobody is waiting for. So the worker main processes (the
        # consumers; the pool children go on, heartbeats too) pause for a while shorter than
        # a ttl, the queue fills with what is published meanwhile, and that is purged.
        mains = [worker.pid for worker in self.pool.live()]
        self.events.record("fault", kind="purge", source="harness", paused=mains,
                           seconds=PURGE_PAUSE)
        for pid in mains:
            self._stopped.add(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

        def purge() -> None:
            try:
                purged = self.broker.purge()
            finally:
                for pid in mains:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
                    self._stopped.discard(pid)
            self.events.record("fault_end", kind="purge", purged=purged)

        self._later(time.monotonic() + PURGE_PAUSE, "purge", purge)

    def _disarm(self) -> None:
        for kind in ("sweep_kill", "finish_exit", "finish_hold", "commit_exit",
                     "publisher_exit"):
            left = self.flags.disarm(kind)
            if left:
                self.events.record("fault_disarmed", kind=kind, tickets_left=left)
