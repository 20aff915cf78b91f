"""The renewer: one thread per worker process, renewing every held lease in batches.

Started lazily by the first claim in a process, so under prefork it lives in the child that
runs the tasks, never in the parent before fork. A refused renewal marks the handle lost at
once; a store that cannot be reached is retried until the lease's local deadline passes, and
then the handle is marked lost too: the heartbeat never assumes it still holds a lease.

It also renews a claim whose reply its task has not read yet (``claiming``, claims.py: under
green pools a busy neighbour can hold that reply past the ttl).

Its thread also keeps the appointments of two queues it does not own: the writes behind a
task's return (``writes_behind``: a fire-and-forget finish, carried by the next claim or sent
alone) and the settle confirmations (``confirmations``). It renews a settling or confirming
lease like a running one, so a slow result backend does not look like a dead owner.

Its store calls are made by the sender pool (``senders``): the scheduling thread never waits
on a store. At shutdown it hands the leases still held to the worker (``abandon``), which
gives them back through their completion (``worker.lifecycle``).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable

from .. import signals
from ..errors import LeaseError
from ..stores.base import Store
from . import green
from .claims import InFlight, running_lease
from .confirmations import Confirmations
from .execution import Execution, Phase
from .senders import SenderPool
from .writes_behind import WritesBehind

__all__ = ["Heartbeat"]

logger = logging.getLogger(__name__)

#: How soon a renewal is tried again after the store failed to answer.
RETRY_AFTER_ERROR = 0.5


class Heartbeat:
    _instance: Heartbeat | None = None
    # Only task code takes this one, never the heartbeat's own threads: under green pools it
    # is a green lock, as it should be.
    _instance_lock = threading.Lock()

    @classmethod
    def for_process(cls) -> Heartbeat:
        """The heartbeat of this process (a new one in a forked child)."""
        with cls._instance_lock:
            if cls._instance is None or cls._instance.pid != os.getpid():
                cls._instance = cls()
            return cls._instance

    @classmethod
    def current(cls) -> Heartbeat | None:
        """This process's heartbeat, if it has one (no thread is started for asking)."""
        instance = cls._instance
        return instance if instance is not None and instance.pid == os.getpid() else None

    def __init__(self) -> None:
        self.pid = os.getpid()
        # The executions it renews, each with when its next renewal is due (monotonic).
        self._handles: dict[Execution, float] = {}
        self._claims: set[InFlight] = set()  # claims sent whose reply is not read yet
        self._sleeping_until = -math.inf  # when the waiting thread wakes by itself
        # Under green pools (-P gevent|eventlet) the threads below are real OS threads, so that
        # a body that never yields cannot stop the renewals, and what they share with task code
        # is real (lease_celery/green.py): this condition, held for a few statements that
        # never yield, and the queue.
        self._green = green.active() is not None
        self._wake: threading.Condition | green.Condition = (
            green.Condition() if self._green else threading.Condition())
        # Store calls wait for a sender thread: the scheduling thread never blocks on a store.
        self._senders = SenderPool()
        #: The writes behind tasks' returns, and the settle confirmations: this thread keeps
        #: their appointments (``_due``), the senders make their store calls.
        self.writes = WritesBehind(self._wake, self._enqueue, in_line=self._green,
                                   sleeping_until=lambda: self._sleeping_until)
        self.confirmations = Confirmations(self._wake, self.unwatch)
        self._thread = green.start_thread(self._run, name="lease-heartbeat")

    @property
    def senders(self) -> SenderPool:
        """The threads that make this process's store calls off the task's path."""
        return self._senders

    def watch(self, handle: Execution) -> None:
        """Renew ``handle``'s lease from now on, first one interval after its claim."""
        with self._wake:
            due = self._handles.setdefault(handle,
                                           handle.claimed_at + handle.heartbeat_interval)
            # The thread sleeps until its next due renewal: wake it only if this handle falls
            # due before that (a new claim usually does not: waking it costs every task).
            if due < self._sleeping_until:
                self._wake.notify()

    def claiming(self, store: Store, key: str, owner: str, *, ttl: float,
                 heartbeat_interval: float) -> InFlight:
        """A claim of ``key`` by ``owner`` is about to be sent: renew the row it writes if its
        reply is not read by the first renewal (claims.py). End it with ``claimed``."""
        claim = InFlight(store, key, owner, ttl=ttl, heartbeat_interval=heartbeat_interval)
        with self._wake:
            self._claims.add(claim)
            if claim.next_renewal_at < self._sleeping_until:
                self._wake.notify()
        return claim

    def claimed(self, claim: InFlight, handle: Execution | None) -> None:
        """The claim's reply was read: ``handle`` holds what it granted (None: nothing, or
        the task gives it up). The handle takes any renewal made of the row meanwhile."""
        with self._wake:
            self._claims.discard(claim)
        claim.answer(handle)

    def unwatch(self, handle: Execution) -> None:
        """Stop renewing ``handle``: nothing is left to renew (it is closed)."""
        handle.enter(Phase.CLOSED)
        with self._wake:
            self._handles.pop(handle, None)

    def settle(self, handle: Execution) -> None:
        """Celery stored this execution's outcome: confirm it soon, and keep renewing the
        settle deadline until the store answers the confirmation. A confirmation that waits
        (a slow reply, a busy sender, an unreachable store) must not let the deadline pass
        under a living owner: a redelivery would complete the key, and Celery store the
        outcome a second time."""
        handle.enter(Phase.CONFIRMING)
        with self._wake:
            self._handles.setdefault(handle, time.monotonic() + handle.heartbeat_interval)
        self.confirmations.add(handle)

    def close_thread_stores(self, timeout: float) -> None:
        """Under green pools, have each sender close its own copies of the stores (the
        process is going; a copy is closed on the thread that opened it, see green.py). Each
        sender then parks: the heartbeat sends nothing more."""
        if not self._green:
            return
        left, guard, closed, park = [self._senders.size], green.lock(), green.Event(), green.Event()

        def close() -> None:
            green.close_thread_stores()
            with guard:
                left[0] -= 1
                if not left[0]:
                    closed.set()
            park.wait()  # so that each sender takes exactly one of these

        self._senders.each(close)
        closed.wait(timeout)

    def abandon(self) -> list[Execution]:
        """Stop renewing every lease still held for work in hand (the process is going away)
        and return them, for the caller to give back. A lease whose finish is being written
        behind the return is finishing, not abandoned; one whose confirmation is on its way
        is done (``confirmations`` sends it)."""
        with self._wake:
            held = [h for h in self._handles
                    if h.phase not in (Phase.FINISHING, Phase.CONFIRMING)]
        for handle in held:
            self.unwatch(handle)
        return held

    def _due(self) -> tuple[list[Execution], list[Execution], list[InFlight]]:
        """Wait until some handle (or unanswered claim) is due for renewal, or a confirmation
        is queued; return the handles to renew, those to settle and the claims to adopt.
        Queued writes that no claim carried in time go to the senders from here."""
        with self._wake:
            while True:
                now = time.monotonic()
                self.writes.fall_due(now)
                settles = self.confirmations.take_due(now)
                claims = [c for c in self._claims if c.next_renewal_at <= now]
                if settles or claims or any(at <= now for at in self._handles.values()):
                    # Some lease is due: renew with it every lease due within half its
                    # interval. Renewing early is safe, and leases that started at different
                    # instants fall into one batch (one round trip per interval per store)
                    # instead of one round trip each.
                    due = [h for h, at in self._handles.items()
                           if at - h.heartbeat_interval / 2 <= now]
                    return due, settles, claims
                wake_at = list(self._handles.values())
                wake_at += [c.next_renewal_at for c in self._claims]
                wake_at += self.writes.wake_times(now)
                wake_at += self.confirmations.wake_times()
                self._sleeping_until = min(wake_at) if wake_at else math.inf
                self._wake.wait(self._sleeping_until - now if wake_at else None)
                self._sleeping_until = -math.inf

    def _run(self) -> None:
        while True:
            try:
                self._schedule()
            except Exception:  # never let the thread die: a dead heartbeat loses every lease
                logger.exception("lease heartbeat scheduling failed; going on in %ss",
                                 RETRY_AFTER_ERROR)
                with self._wake:
                    self._sleeping_until = time.monotonic() + RETRY_AFTER_ERROR
                    self._wake.wait(RETRY_AFTER_ERROR)
                    self._sleeping_until = -math.inf

    def _schedule(self) -> None:
        """Wait for what falls due, and hand it to the senders."""
        due, settles, claims = self._due()
        if settles:
            self._enqueue(functools.partial(self.confirmations.send, settles))
        if claims:
            self._schedule_adoption(claims)
        groups: dict[tuple[Store, float], list[Execution]] = defaultdict(list)
        for handle in due:
            groups[handle.store, handle.ttl].append(handle)
        for (store, ttl), handles in groups.items():
            # Scheduled at sending, not when the reply comes: the next renewal goes out on
            # time even while this one is still waiting for a slow store.
            sent_at = time.monotonic()
            with self._wake:
                delays = [max(0.0, sent_at - self._handles.get(handle, sent_at))
                          for handle in handles]
                for handle in handles:
                    self._reschedule(handle, sent_at + handle.heartbeat_interval)
            # Under green pools, each sender renews through its own copy of the store.
            self._enqueue(functools.partial(self._renew_or_retry, green.per_thread(store),
                                               ttl, handles, sent_at, delays))

    def _schedule_adoption(self, claims: list[InFlight]) -> None:
        """Queue the adoption of claims whose reply is still unread, one call per store; a
        claim whose deadline passed with nothing renewed is given up (its reply decides)."""
        now = time.monotonic()
        groups: dict[Store, list[InFlight]] = defaultdict(list)
        with self._wake:
            for claim in claims:
                if now >= claim.deadline:
                    self._claims.discard(claim)
                    continue
                claim.next_renewal_at = now + claim.heartbeat_interval
                groups[claim.store].append(claim)
        for store, group in groups.items():
            self._enqueue(functools.partial(self._adopt, green.per_thread(store), group))

    def _adopt(self, store: Store, claims: list[InFlight]) -> None:
        """Renew the rows these unanswered claims wrote (read first, the first time: a row is
        adopted only if it names the claim's owner). A claim not on the store yet is looked at
        again next interval; a refused renewal ends the adoption (the reply, read late, then
        finds its deadline passed, as before)."""
        for claim in claims:
            sent_at = time.monotonic()
            if claim.answered or sent_at >= claim.deadline:
                continue  # answered, or too late to keep anything the store granted
            try:
                lease = claim.adopted
                if lease is None:
                    record = store.get(claim.key)
                    lease = None if record is None or record.owner != claim.owner \
                        else running_lease(record)
                    if lease is None:
                        claim.not_landed(sent_at, 0 if record is None else record.token)
                        continue
                renewed = store.renew_many([lease], ttl=claim.ttl)[0]
            except LeaseError as exc:
                logger.warning("lease %s: renewal of a claim whose reply is unread failed, "
                               "retrying: %s", claim.key, exc)
                claim.next_renewal_at = time.monotonic() + RETRY_AFTER_ERROR
                continue
            if renewed is None:
                with self._wake:
                    self._claims.discard(claim)
                continue
            logger.info("lease %s token %s: renewed for a claim whose reply is still unread "
                        "(a busy neighbour holds the worker)", claim.key, renewed.token)
            claim.renewed(renewed, sent_at)

    def _enqueue(self, call: Callable[[], None]) -> None:
        self._senders.put(call)

    def _reschedule(self, handle: Execution, at: float) -> None:
        """The next renewal of ``handle`` is due ``at`` (if it is still renewed). Call with
        ``self._wake`` held."""
        if handle in self._handles:
            self._handles[handle] = at

    def _retry_soon(self, handles: list[Execution]) -> None:
        with self._wake:
            for handle in handles:
                self._reschedule(handle, time.monotonic() + RETRY_AFTER_ERROR)

    def _renew_or_retry(self, store: Store, ttl: float, handles: list[Execution],
                        sent_at: float, delays: list[float]) -> None:
        try:
            self._renew(store, ttl, handles, sent_at, delays)
        except Exception:
            self._retry_soon(handles)
            raise

    def _renew(self, store: Store, ttl: float, handles: list[Execution], sent_at: float,
               delays: list[float]) -> None:
        try:
            renewed = store.renew_many([h.lease for h in handles], ttl=ttl)
        except LeaseError as exc:
            for handle in handles:
                if handle.phase is Phase.CONFIRMING:
                    # Done: the confirmation (retried until it lands) decides, not a deadline.
                    self._retry_soon([handle])
                elif time.monotonic() >= handle.local_deadline:
                    self._lose(handle, f"store unreachable until the lease deadline ({exc})")
                else:
                    logger.warning("lease %s token %s: renewal failed, retrying: %s",
                                   handle.key, handle.token, exc)
                    self._retry_soon([handle])
            return
        for handle, lease, delay in zip(handles, renewed, delays, strict=True):
            if not handle.renewal_counts:
                continue  # finished or released meanwhile: a refusal now means nothing
            if lease is None and handle.phase is Phase.CONFIRMING:
                # Settled by the confirmation whose reply is still on its way, or taken over
                # past the deadline: nothing left to renew; the confirmation's answer says which.
                self.unwatch(handle)
            elif lease is None:
                self._lose(handle, "renewal refused by the store (expired or taken over)")
            else:
                handle.renewed(lease, sent_at=sent_at)
                signals.lease_renewed.send(sender=handle.task, key=lease.key, lease=lease,
                                           delay=delay)

    def _lose(self, handle: Execution, reason: str) -> None:
        self.unwatch(handle)
        if handle.mark_lost(reason):
            logger.warning("lease %s owner %s token %s lost: %s",
                           handle.key, handle.owner, handle.token, reason)
            signals.lease_lost.send(sender=handle.task, key=handle.key, lease=handle.lease,
                                    reason=reason, hold_time=handle.held_for)
