"""The gate: one delivery's path through the lease, claim → run → outcome → complete.

``LeasedTask.__call__`` hands each delivery to a ``Gate``. It claims the key (waiting out a
short store outage), admits the claim or answers the delivery from the key's outcome, runs the
body under the heartbeat, and writes the outcome through a completion: in line, behind the
return, or carried by the next claim. What happens when the attempt does not simply finish
(deferral, retry, release, dead, a refused outcome) is ``ending.Ending``'s.

The worker calls the task with the request already pushed, so ``task.request`` is the
delivery being run; the gate calls ``task.run`` itself, never Celery's ``__call__``, which
would push a fresh request.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, NoReturn

from celery.backends.rpc import RPCBackend
from celery.exceptions import Ignore
from celery.result import ResultBase

from .. import signals
from ..errors import (
    LeaseCancelled,
    LeaseDead,
    LeaseDone,
    LeaseError,
    LeaseHeld,
    LimitReached,
    ResultNotSerializable,
    StoreError,
)
from ..identity import execution_owner
from ..keys import DIRECT_KEY_PREFIX, resolve_key
from ..limits import GroupLimit, LimitRefused
from ..models import Lease, LeaseRecord, LeaseState
from ..runtime.claims import InFlight
from ..runtime.execution import Execution, Phase
from ..runtime.heartbeat import Heartbeat
from ..settings import LeaseSettings
from ..stores.base import Store
from .answers import Answer, answer_key, answers_elsewhere, failure_of
from .background import CarriedFinish, finish_in_background
from .completion import Completion
from .delivery import CONTEXT, task_info
from .ending import Ending, result_backend
from .limited import describe, group_of, note_wait, refusal_delay
from .outage import deferral_reason, retrying
from .settle import freeze_links
from .transactional import AppTransaction

__all__ = ["CLAIM_ROUNDS", "STORE_RETRY_DELAY", "Gate"]

logger = logging.getLogger(__name__)

#: How many times a delivery re-tries a claim that raced with a release or an expiry.
CLAIM_ROUNDS = 3
#: Seconds (at most ttl) before a delivery that met an unavailable store runs again.
STORE_RETRY_DELAY = 5.0


class _AlreadyDone(Exception):  # control flow only: never escapes the gate
    """Raised by the claim when an eager run finds its key done or dead: it is answered with
    the accepted outcome, as a delivery under another task id is, instead of running again."""

    def __init__(self, record: LeaseRecord) -> None:
        super().__init__()
        self.record = record

    def outcome(self) -> Any:
        """The accepted outcome, for Celery to store and pass to the callbacks again."""
        if self.record.state is LeaseState.DEAD:
            raise LeaseDead(f"lease {self.record.key!r} is dead: {self.record.reason}")
        return self.record.result


class _SettlementTaken(_AlreadyDone):  # caught before _AlreadyDone
    """Raised by the claim when this delivery completes a key whose owner died settling it:
    the accepted outcome, and the execution that now settles it."""

    def __init__(self, handle: Execution, record: LeaseRecord) -> None:
        super().__init__(record)
        self.handle = handle


class Gate:
    """One delivery of ``task`` (its request pushed) with ``args`` and ``kwargs``."""

    def __init__(self, task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.task, self.args, self.kwargs = task, args, kwargs
        self.request = task.request
        self.settings: LeaseSettings = task.lease_settings
        self.store: Store = task.lease_store
        self.ending = Ending(task, self.settings)
        self.heartbeat = Heartbeat.for_process()

    def run(self) -> Any:
        """Claim the key, run the body and complete its outcome; what Celery gets back."""
        request, heartbeat = self.request, self.heartbeat
        # A direct call has no delivery id; it is still the protected work, so it runs under a
        # lease too, on a key of its own unless lease_key names one.
        task_id = request.id or (f"{DIRECT_KEY_PREFIX}{uuid.uuid4()}"
                                 if request.called_directly else None)
        key = resolve_key(self.task.lease_key, self.task.run, self.args, self.kwargs,
                          task_id=task_id)
        limit = group_of(self.task, self.settings, self.args, self.kwargs)
        # A short outage is waited out (about a ttl) rather than re-published at once.
        wait = self.ending.store_wait(key)
        try:
            handle = retrying(lambda: self._claim(key, limit), wait)
        except StoreError as exc:
            # The store still cannot answer: keep the delivery rather than fail and ack it.
            self._defer(key, min(self.settings.ttl, STORE_RETRY_DELAY),
                        why=deferral_reason(wait, exc), eager_error=exc, recovery=True)
        except _SettlementTaken as taken:
            request.lease = taken.handle
            heartbeat.watch(taken.handle)  # renews the completer's settle deadline
            freeze_links(request)
            return taken.outcome()
        except Answer as answer:
            return self._answer(answer)
        except _AlreadyDone as done:
            return done.outcome()
        request.lease = handle
        heartbeat.watch(handle)
        started = time.monotonic()
        try:
            freeze_links(request)
            # A claim whose reply came back after its own deadline (a stalled process, a
            # green pool's busy loop) holds nothing: never start the body on it.
            handle.view.check()
            result = self.task.run(*self.args, **self.kwargs)
        except BaseException as exc:
            if handle.app_finish is not None:
                return self._committed(handle, None, raised=exc)
            heartbeat.unwatch(handle)
            self.ending.after_error(handle, exc)
            raise
        handle.body_returned(time.monotonic() - started)
        if handle.app_finish is not None:
            return self._committed(handle, result)
        return self._finish(handle, result)

    def _defer(self, key: str, remaining: float, **how: Any) -> NoReturn:
        self.ending.defer(key, remaining, self.args, self.kwargs, **how)

    # -- before the body --------------------------------------------------------------------

    def _claim(self, key: str, limit: GroupLimit | None, *,
               answering: bool = False) -> Execution:
        owner = execution_owner()
        request, store, heartbeat, ttl = self.request, self.store, self.heartbeat, self.settings.ttl
        info = (None if request.called_directly
                else task_info(self.task, request, self.args, self.kwargs))
        context = None if info is None else info[CONTEXT]
        for _ in range(CLAIM_ROUNDS):
            # The heartbeat knows the claim before it is sent: under a green pool a busy
            # neighbour may hold the reply past the ttl, and it then renews the row meanwhile.
            claim = heartbeat.claiming(store, key, owner, ttl=ttl,
                                       heartbeat_interval=self.settings.heartbeat_interval)
            lease: Lease | LimitRefused | None
            # A previous delivery's finish behind its return, carried in this claim's own
            # transaction (execution.background): one commit for both.
            carried = None if limit is not None else heartbeat.writes.take_carried(store)
            try:
                if isinstance(carried, CarriedFinish):
                    lease = _claim_carrying(store, carried, key, owner, ttl, info)
                elif limit is None:
                    lease = store.claim(key, owner=owner, ttl=ttl, task=info)
                else:
                    # An eager call has no message to park: without task info it is refused
                    # and raises (LimitReached).
                    lease = store.claim_limited(key, owner=owner, ttl=ttl, limit=limit,
                                                task=None if request.is_eager else info)
            except BaseException:
                heartbeat.claimed(claim, None)
                raise
            if isinstance(lease, LimitRefused):
                heartbeat.claimed(claim, None)
                self._limit_refused(key, lease)
            if lease is not None:
                return self._admit(lease, claim)
            heartbeat.claimed(claim, None)
            record = store.get(key)
            if record is None:
                continue  # purged between our claim and our look: claim again
            if (record.settling and not answers_elsewhere(record, request.id, context)
                    and not (request.is_eager or request.called_directly)):
                self._complete(record, owner)
                continue  # another delivery took the settlement first: look again
            if record.state in (LeaseState.DONE, LeaseState.DEAD):
                if (not answering and answers_elsewhere(record, request.id, context)
                        and not (request.is_eager or request.called_directly)):
                    # Done under another task id, or this id applied in another place: this
                    # delivery gets its own answer (see answers.py), claimed like any work on
                    # a key of its own (an answer's key is no work of the group: no limit).
                    asker = (request.id if record.task_id != request.id
                             else f"{request.id}@{context}")
                    raise Answer(self._claim(answer_key(key, asker), None, answering=True),
                                 record)
                self._ignore_done(record)
            now = store.now()
            if record.state is LeaseState.READY:
                if record.not_before is None or record.not_before <= now:
                    continue  # released between our claim and our look: claim again
                backing_off = LeaseHeld(f"lease {key!r} is backing off for another "
                                        f"{record.not_before - now:.1f}s after: {record.reason}")
                self._defer(key, record.not_before - now, why=str(backing_off),
                            eager_error=backing_off)
            remaining = (record.expires_at or 0.0) - now
            if remaining > 0:
                held = LeaseHeld(f"lease {key!r} is held by {record.owner} (token "
                                 f"{record.token}) for another {remaining:.1f}s")
                self._defer(key, remaining, holder=record.owner, why=str(held),
                            eager_error=held)
        # Lost the race several times in a row (expiries and takeovers crossing ours).
        contended = LeaseHeld(f"lease {key!r}: {CLAIM_ROUNDS} claims in a row lost a race")
        self._defer(key, 0.0, why=str(contended), eager_error=contended)

    def _ignore_done(self, record: LeaseRecord) -> NoReturn:
        """A copy of the delivery that reached the key's outcome: dropped (a direct call is
        told why; an eager one gets the outcome)."""
        request = self.request
        logger.info("lease %s is %s (token %s): delivery %s ignored",
                    record.key, record.state.value, record.token, request.id)
        signals.duplicate_ignored.send(sender=self.task, key=record.key,
                                       state=record.state.value, record=record)
        if request.called_directly:
            # The caller gets no result and no run: say why, not a bare Ignore.
            raise _finished_already(record)
        if request.is_eager:
            raise _AlreadyDone(record)  # the eager caller gets the accepted outcome
        raise Ignore()

    def _limit_refused(self, key: str, refusal: LimitRefused) -> NoReturn:
        """The group refused: a parked delivery is acked (``Ignore``: it waits on the
        store, holding no pool process); one over the rate, or that could not be parked,
        comes back at the group's next allowed start."""
        if refusal.parked:
            note_wait(self.task, key, refusal)
            raise Ignore()
        reached = LimitReached(f"lease {key!r}: {describe(refusal)}")
        self._defer(key, refusal_delay(refusal, self.settings, self.store.now()),
                    why=str(reached), eager_error=reached, jitter=False)

    def _complete(self, record: LeaseRecord, owner: str) -> None:
        """This very task id is done (or dead) and still settling: Celery may not have stored
        its outcome. While its owner's settle deadline lasts, the owner is alive and settles it:
        come back after the deadline. Past it, the owner is gone: take the settlement over and
        complete the key (raises ``_SettlementTaken``); returns if another delivery took it
        first."""
        store, request = self.store, self.request
        remaining = (record.expires_at or 0.0) - store.now()
        if remaining > 0:
            settling = LeaseHeld(f"lease {record.key!r} is {record.state.value}; its owner "
                                 f"{record.owner} settles it for another {remaining:.1f}s")
            self._defer(record.key, remaining, holder=record.owner, why=str(settling),
                        eager_error=settling)
        sent_at = time.monotonic()  # before the write: the local deadline never outlives it
        lease = store.claim_settlement(record.key, owner=owner, ttl=self.settings.ttl)
        if lease is None:
            return
        if record.state is LeaseState.DONE and self._success_stored():
            # The owner was slow, not dead: Celery stored its SUCCESS, and sends callbacks
            # before it stores a success, so only the confirmation is missing. Writing the
            # outcome again would be a second result write by a live pair of workers.
            logger.info("lease %s is done and Celery stored the outcome of task %s: delivery "
                        "%s confirms the settlement (token %s)", record.key, request.id,
                        request.id, lease.token)
            store.settle(lease)
            raise Ignore()
        logger.warning("lease %s is %s but its owner %s died before Celery stored the outcome:"
                       " delivery %s completes it (token %s)", record.key, record.state.value,
                       record.owner, request.id, lease.token)
        signals.settle_completed.send(sender=self.task, key=record.key, lease=lease,
                                      state=record.state.value)
        handle = self._execution(lease, sent_at)
        handle.enter(Phase.SETTLING)
        raise _SettlementTaken(handle, record)

    def _success_stored(self) -> bool:
        """Does Celery's result backend hold this task id's SUCCESS? (False when results are
        not stored, or the backend cannot say.)"""
        request, task = self.request, self.task
        if request.is_eager or getattr(request, "ignore_result", False) \
                or task.ignore_result or isinstance(result_backend(task), RPCBackend):
            return False  # rpc:// answers PENDING inside a worker: it cannot tell
        try:
            return bool(task.AsyncResult(request.id).state == "SUCCESS")
        except Exception:  # a backend that cannot answer: complete as if nothing was stored
            logger.debug("lease_celery: the result backend could not say whether task %s "
                         "succeeded", request.id, exc_info=True)
            return False

    def _execution(self, lease: Lease, sent_at: float) -> Execution:
        return Execution(lease, store=self.store, ttl=self.settings.ttl,
                         heartbeat_interval=self.settings.heartbeat_interval, sent_at=sent_at,
                         task=self.task, transactions=self._app_transaction)

    def _app_transaction(self, handle: Execution, connection: Any) -> AppTransaction:
        return AppTransaction(self.task, self.ending, handle, connection)

    def _admit(self, lease: Lease, claim: InFlight) -> Execution:
        """A claim succeeded: run it, unless the policy says the key has had enough."""
        handle, heartbeat, task = self._execution(lease, claim.sent_at), self.heartbeat, self.task
        # Watched before anything here may yield (a signal receiver, a log handler), and
        # given whatever the heartbeat renewed while the reply waited unread.
        heartbeat.watch(handle)
        heartbeat.claimed(claim, handle)
        logger.info("lease %s acquired by %s with token %s (attempt %s, takeovers %s)",
                    lease.key, lease.owner, lease.token, lease.attempts, lease.takeovers)
        signals.lease_acquired.send(sender=task, key=lease.key, lease=lease)
        if lease.takeovers:
            signals.lease_taken_over.send(sender=task, key=lease.key, lease=lease)
        if lease.cancel is not None:
            heartbeat.unwatch(handle)  # kill watches it again if the failure settles
            # Cancelled while its holder was gone: this delivery never runs the body.
            self.ending.kill(handle, lease.cancel)
            raise LeaseCancelled(f"lease {lease.key!r} was {lease.cancel}")
        reason = self.settings.policy.on_claim(attempts=lease.attempts, takeovers=lease.takeovers)
        if reason is not None:
            heartbeat.unwatch(handle)
            self.ending.kill(handle, reason)
            raise LeaseDead(f"lease {lease.key!r} is dead: {reason}")
        return handle

    def _answer(self, answer: Answer) -> Any:
        """Answer a duplicate with the accepted outcome of the key it duplicates, under its
        own answer lease: Celery stores it under this delivery's id and sends this delivery's
        callbacks and chord part, as if the body had run."""
        handle, record, request = answer.handle, answer.record, self.request
        request.lease = handle
        freeze_links(request)
        logger.info("lease %s is %s under task %s: delivery %s answered with its outcome "
                    "(answer key %s, token %s)", record.key, record.state.value,
                    record.task_id, request.id, handle.key, handle.token)
        signals.duplicate_answered.send(sender=self.task, key=record.key,
                                        state=record.state.value, record=record,
                                        lease=handle.lease)
        if record.state is LeaseState.DEAD:
            self.heartbeat.unwatch(handle)  # kill watches it again if the failure settles
            self.ending.kill(handle, record.reason or "dead", error=record.result)
            raise failure_of(record, result_backend(self.task))
        self.heartbeat.watch(handle)
        return self._finish(handle, record.result)

    # -- after the body ---------------------------------------------------------------------

    def _committed(self, handle: Execution, result: Any, *,
                   raised: BaseException | None = None) -> Any:
        """The body wrote its finish in the app's transaction (``transactional``): once that
        transaction is known committed, say the verdict as a finish in line does. The outcome
        is the committed one: an exception the body raised after the commit is logged, not
        the task's failure (the key is done; a redelivery would be answered with that)."""
        finish = handle.app_finish
        assert finish is not None
        if not finish.committed and not self._finish_committed(handle):
            # The app's transaction that held the finish rolled back, or was left open: the
            # body's rows are not committed either, so the key's work is still to do.
            self.heartbeat.unwatch(handle)
            failed = LeaseError(f"lease {handle.key!r}: the transaction that wrote the finish "
                                "did not commit (rolled back, or still open when the task "
                                "returned)")
            self.ending.after_error(handle, raised or failed)
            raise raised or failed
        if raised is not None:
            logger.error("lease %s token %s: the body raised after its outcome was committed; "
                         "the committed outcome stands", handle.key, handle.token,
                         exc_info=raised)
            result = finish.result
        elif result != finish.result:
            logger.warning("lease %s: the body returned a result other than the one committed "
                           "with its finish (tx.complete(...)); a redelivery is answered with "
                           "the committed one", handle.key)
        Completion(self.task, handle).finished(settle_within=finish.settle_within)
        return result

    def _finish_committed(self, handle: Execution) -> bool:
        """Is the key done under this execution's lease (the app committed its finish)?"""
        try:
            record = self.store.get(handle.key)
        except StoreError:
            return True  # written in the app's transaction: assume it, as the row will say
        return (record is not None and record.state is LeaseState.DONE
                and record.token == handle.token and record.owner == handle.owner)

    def _finish(self, handle: Execution, result: Any) -> Any:
        # Still watched: if the finish is accepted, the heartbeat renews the settle deadline
        # until Celery has stored the result (after_return).
        heartbeat, request = self.heartbeat, self.request
        if handle.cancelled is not None:
            # The body returned after the cancel reached it: the cancel wins, as if check()
            # had raised at the end.
            heartbeat.unwatch(handle)
            self.ending.kill(handle, handle.cancelled)
            raise LeaseCancelled(f"lease {handle.key!r} was {handle.cancelled}")
        settle_within = self.ending.settle_within()
        # The row keeps the result as Celery's backend stores it (a GroupResult as its tuple
        # form): a result Celery can store, the lease store can keep.
        stored = (result_backend(self.task).prepare_value(result)
                  if isinstance(result, ResultBase) else result)
        mode = self.settings.finish_mode(handle.body_seconds,
                                         store_carries=handle.store.carries_finish)
        if (settle_within is None and mode != "inline"
                and handle.lease.group is None  # its waiters are handed on from here
                and not (request.is_eager or request.called_directly)):
            # Nothing Celery does next depends on the verdict: write it behind the return.
            try:
                finish_in_background(self.task, handle, stored, heartbeat,
                                     carried=mode == "carried")
            except ResultNotSerializable as exc:
                heartbeat.unwatch(handle)
                self.ending.after_error(handle, exc)
                raise
            return result
        # As the claim does, the finish waits out a short outage.
        wait = self.ending.store_wait(handle.key, step="the finish of")
        try:
            accepted = Completion(self.task, handle).finish(stored, settle_within=settle_within,
                                                            wait=wait)
        except ResultNotSerializable as exc:
            heartbeat.unwatch(handle)
            self.ending.after_error(handle, exc)
            raise
        except StoreError as exc:
            # Not recorded, so not accepted: run again later rather than report an unfenced
            # success or fail and ack (which would lose the work).
            heartbeat.unwatch(handle)
            self.ending.release(handle, reason=f"finish failed in the lease store: {exc}")
            self._defer(handle.key, min(self.settings.ttl, STORE_RETRY_DELAY),
                        why=deferral_reason(wait, exc, failed="finish failed in the lease store"),
                        eager_error=exc, recovery=True)
        if not accepted:
            self.ending.not_current(handle, "finish refused: the lease expired or was taken over")
        return result


def _claim_carrying(store: Store, finishing: CarriedFinish, key: str, owner: str, ttl: float,
                    info: Any) -> Lease | None:
    """The claim of ``key`` carrying a previous delivery's finish (``take_carried``): its
    verdict goes to that delivery (its signals, with its request); if the store fails, a
    sender writes the finish alone and the claim's failure is this delivery's."""
    try:
        accepted, lease = store.finish_and_claim(finishing.lease, finishing.encoded, key,
                                                 owner=owner, ttl=ttl, task=info)
    except BaseException:
        finishing.give_back()
        raise
    finishing.done(accepted)
    return lease


def _finished_already(record: LeaseRecord) -> LeaseError:
    """What a direct call of a key that is done (or dead) raises instead of running it."""
    if record.state is LeaseState.DEAD:
        return LeaseDead(f"lease {record.key!r} is dead with token {record.token} "
                         f"({record.reason}): the call did not run it; requeue the key to run "
                         "it again")
    return LeaseDone(f"lease {record.key!r} is done with token {record.token}: the call did "
                     f"not run it again (its accepted result is the row's: "
                     f"store.get({record.key!r}).result); purge the key to run it again")
