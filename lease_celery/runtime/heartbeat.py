"""One renewal thread per worker process, renewing every held lease in batches.

Started lazily by the first claim in a process, so under prefork it lives in the child that
runs the tasks, never in the parent before fork. A refused renewal marks the handle lost at
once; a store that cannot be reached is retried until the lease's local deadline passes, and
then the handle is marked lost too: the heartbeat never assumes it still holds a lease.

It also renews a claim whose reply its task has not read yet (``claiming``, claims.py: under
green pools a busy neighbour can hold that reply past the ttl).

It also writes what the task's own path need not wait for: a fire-and-forget task's finish
(``background``; first offered to this process's next claim on the same store, which carries
it in its own transaction, and written here only if no claim took it in time), and the
confirmations that end settle phases: once Celery stored a task's
outcome, the owner's confirmation is queued here and sent in batches (``settle_many``), so the
task's own path pays no extra round trip. Until then the settling lease is renewed like a
running one, so a slow result backend does not look like a dead owner.

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
from .execution import Execution, Phase
from .senders import SenderPool

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
        self._to_settle: list[Execution] = []
        self._settle_after = 0.0  # monotonic time before which a failed settle is not retried
        self._sleeping_until = -math.inf  # when the waiting thread wakes by itself
        # Under green pools (-P gevent|eventlet) the threads below are real OS threads, so that
        # a body that never yields cannot stop the renewals, and what they share with task code
        # is real (lease_celery/green.py): this condition, held for a few statements that
        # never yield, and the queue.
        self._green = green.active() is not None
        self._wake: threading.Condition | green.Condition = (
            green.Condition() if self._green else threading.Condition())
        # Background writes (a finish behind the task's return), by handle: queued ones until a
        # sender takes them, and the handles whose write a sender is making now. A process that
        # is going sends the queued ones itself and waits for the others (flush_background).
        self._queued: dict[Execution, Callable[[], None]] = {}
        self._in_flight: set[Execution] = set()
        # Queued writes that the next claim on their store may carry (take_carried), each
        # with the instant it goes to a sender if none has, its store and what the claim needs.
        self._carriable: dict[Execution, tuple[float, Store, object]] = {}
        # Threads in flush_background waiting for in-flight writes. Only they need to hear
        # that one ended: the scheduling thread waits on the same condition, and waking it
        # for every finish (twice per task when the next claim carries it) cost a wake-up
        # per task that it spent finding nothing to do.
        self._flushing = 0
        # When the scheduling thread looks at the queued writes next because one fell due
        # (in_background woke it for that one): it keeps that appointment even if a claim
        # carries the write first. Woken for each finish instead, it would find the next claim
        # had already carried it by the time it ran, sleep until the next renewal, and be
        # woken again by the next task's finish: a wake-up per task. So the finishes queued
        # before that instant wake nobody, and the thread wakes about once per ``within``
        # while finishes come, twice for one that comes alone.
        self._carry_check_at = math.inf
        # Store calls wait for a sender thread: the scheduling thread never blocks on a store.
        self._senders = SenderPool()
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
            self._to_settle.append(handle)
            if len(self._to_settle) == 1:  # later ones join the batch the thread will send
                self._wake.notify()

    def in_background(self, handle: Execution, write: Callable[[], None], *,
                      carry: object = None, within: float = 0.0) -> None:
        """Make ``write`` (the handle's last store call) on a sender thread, soon. The handle
        stays watched until ``write`` unwatches it: a write that waits behind slow store calls
        keeps its lease alive meanwhile. A renewal refused once the write is queued means
        nothing (the write itself says whether the lease was still current).

        With ``carry``, the write waits up to ``within`` seconds for this process's next claim
        on the handle's store to take it (``take_carried``: ``carry`` is what that claim needs
        to make the write itself); only then does a sender make it. A busy process thus
        writes each finish in the next claim's transaction, and the scheduling thread wakes
        about once per ``within``, not once per finish.

        Under green pools the write is made here, in the task's greenlet, before it returns:
        on a sender (a real OS thread) it would use the store the tasks share, which is not
        safe across OS threads there (lease_celery/green.py). Other greenlets run meanwhile."""
        handle.enter(Phase.FINISHING)
        if self._green:
            try:
                write()
            except Exception:
                logger.exception("lease background write failed")
            return
        with self._wake:
            self._queued[handle] = write
            if carry is not None and within > 0:
                due = time.monotonic() + within
                self._carriable[handle] = (due, handle.store, carry)
                if due < self._sleeping_until:
                    self._carry_check_at = min(self._carry_check_at, due)
                    self._wake.notify()
                return
        self._enqueue(functools.partial(self._write_queued, handle))

    def take_carried(self, store: Store) -> object | None:
        """What the oldest queued write that a claim on ``store`` may carry handed to
        ``in_background`` (``carry``), now the caller's to make (end it with ``carried``), or
        None. Taken at most once: by one claim, or by the sender it went to when nobody took
        it in time, or by a process flushing its writes."""
        with self._wake:
            for handle, (_, owner_store, carry) in self._carriable.items():
                if owner_store is not store:
                    continue
                del self._carriable[handle]
                if self._queued.pop(handle, None) is None:
                    return None  # flushed meanwhile (the process is going)
                self._in_flight.add(handle)
                return carry
        return None

    def carried(self, handle: Execution) -> None:
        """A claim made (or gave back) the write it took with ``take_carried``."""
        self._written(handle)

    def _written(self, handle: Execution) -> None:
        with self._wake:
            self._in_flight.discard(handle)
            if self._flushing:
                self._wake.notify_all()

    def _write_queued(self, handle: Execution) -> None:
        with self._wake:
            write = self._queued.pop(handle, None)
            if write is None:
                return  # the process flushed it itself
            self._in_flight.add(handle)
        try:
            write()
        finally:
            self._written(handle)

    def flush_background(self, timeout: float) -> None:
        """Make the queued background writes now, in the calling thread, and wait up to
        ``timeout`` seconds for those a sender is making (the process is going)."""
        with self._wake:
            queued = list(self._queued.values())
            self._queued.clear()
            self._carriable.clear()
        for write in queued:
            try:
                write()
            except Exception:
                logger.exception("lease background write failed")
        deadline = time.monotonic() + timeout
        with self._wake:
            self._flushing += 1
            try:
                while self._in_flight and time.monotonic() < deadline:
                    self._wake.wait(deadline - time.monotonic())
            finally:
                self._flushing -= 1

    def flush_settles(self) -> None:
        """Send the queued confirmations now, in the calling thread (the process is going)."""
        with self._wake:
            pending, self._to_settle = self._to_settle, []
        self._send_settles(pending)

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
        is done (``flush_settles`` sends it)."""
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
                uncarried = [h for h, (due, _, _) in self._carriable.items() if due <= now]
                for handle in uncarried:
                    del self._carriable[handle]
                    self._enqueue(functools.partial(self._write_queued, handle))
                settles: list[Execution] = []
                if self._to_settle and now >= self._settle_after:
                    settles, self._to_settle = self._to_settle, []
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
                wake_at += [due for due, _, _ in self._carriable.values()]
                if self._carry_check_at <= now:
                    self._carry_check_at = math.inf  # kept (what fell due was handed on above)
                elif self._carry_check_at < math.inf:
                    wake_at.append(self._carry_check_at)
                if self._to_settle:
                    wake_at.append(self._settle_after)
                self._sleeping_until = min(wake_at) if wake_at else math.inf
                self._wake.wait(self._sleeping_until - now if wake_at else None)
                self._sleeping_until = -math.inf

    def _send_settles(self, handles: list[Execution]) -> None:
        """Confirm settled outcomes, one round trip per store. A store that fails is asked
        again shortly, until it answers: the confirmation is idempotent, and it is worth
        sending even past the settle deadline (until a redelivery takes the settlement over,
        the owner's confirmation is what keeps the outcome from being stored twice)."""
        groups: dict[Store, list[Execution]] = defaultdict(list)
        for handle in handles:
            groups[handle.store].append(handle)
        for store, group in groups.items():
            try:
                # This thread's own copy of the store under green pools (green.thread_store).
                answers = green.thread_store(store).settle_many([h.lease for h in group])
            except LeaseError as exc:
                logger.warning("lease settle confirmation failed (%s); %d retried", exc,
                               len(group))
                with self._wake:
                    self._to_settle += group
                    self._settle_after = time.monotonic() + RETRY_AFTER_ERROR
                    self._wake.notify()  # the scheduler recomputes when to wake
                continue
            for handle, settled in zip(group, answers, strict=True):
                self.unwatch(handle)
                if settled:
                    signals.lease_settled.send(sender=handle.task, key=handle.key,
                                               lease=handle.lease)
                else:
                    logger.warning("lease %s token %s: settle refused (completed by another "
                                   "delivery after the settle deadline)", handle.key,
                                   handle.token)

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
            self._enqueue(functools.partial(self._send_settles, settles))
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
