"""LeasedTask: the gate between Celery's Task API and the lease (claim, body, finish).

The lease gate lives in ``__call__`` (signal receivers cannot stop a task). The worker calls
``__call__`` with the request already pushed, so ``self.request`` is the delivery being run; we
call ``self.run`` ourselves, never ``super().__call__``, which would push a fresh request.
How an attempt that did not simply finish ends (deferral, retry, release, dead, stale
refusal) lives in its base class, ``attempts.AttemptEnding``; the settle phase after an
accepted outcome in ``settle``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar, NoReturn

from celery.backends.rpc import RPCBackend
from celery.exceptions import Ignore
from celery.result import ResultBase

from . import signals
from .catalog import KEY_SPEC, SETTINGS, task_attributes
from .errors import (
    LeaseCancelled,
    LeaseDead,
    LeaseDone,
    LeaseError,
    LeaseHeld,
    LimitReached,
    ResultNotSerializable,
    StoreError,
)
from .execution.answers import Answer, answer_key
from .execution.attempts import AttemptEnding
from .execution.background import CarriedFinish, finish_in_background
from .execution.completion import Completion
from .execution.delivery import body_signature, task_info
from .execution.limited import describe, group_of, note_wait, refusal_delay
from .execution.outage import deferral_reason, retrying
from .execution.published import record_at_publish, withdraw
from .execution.settle import SettlementCheck, confirm_stored, freeze_links
from .execution.unique import existing_holder
from .identity import execution_owner
from .keys import check_key_spec, resolve_key
from .limits import LimitRefused
from .models import Lease, LeaseRecord, LeaseState
from .runtime.claims import InFlight
from .runtime.execution import Execution, Phase
from .runtime.handle import LeaseHandle
from .runtime.heartbeat import Heartbeat
from .settings import LeaseSettings
from .stores.base import Store
from .stores.registry import shared_store
from .wiring import install

__all__ = ["LeasedTask"]

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


class LeasedTask(AttemptEnding):
    """A Celery task whose body runs under a fenced, heartbeated lease.

    Options (task attributes, or ``@app.task(..., lease_key=...)``):

    ``lease_key``
        ``"report:{report_id}"`` (format string over the arguments), a callable, or ``None``
        (the task id).
    ``lease_ttl``, ``lease_heartbeat_interval``, ``lease_store_url``,
    ``lease_retry_time_limits``, ``lease_retry_errors``, ``lease_finish_in_background``
        Override the ``lease_*`` Celery settings for this task.
    ``lease_unique``
        ``True``: ``apply_async`` returns the ``AsyncResult`` of the key's live or done holder
        instead of publishing again (also per call: ``apply_async(..., lease_unique=True)``).
    ``lease_record_at_publish``
        ``True``: ``apply_async`` writes the key's row (``ready``, with the message) before
        publishing, so the sweeper re-publishes a message the broker loses (also the setting,
        and per call: ``apply_async(..., lease_record=True)``).
    ``lease_extend_visibility``
        ``True``: on SQS and kombu's Redis transport the worker keeps the message invisible
        to other consumers while its lease is renewed (also the setting; see
        ``lease_celery.worker.visibility``).
    ``lease_limit``, ``lease_rate_limit``, ``lease_limit_key``
        At most ``lease_limit`` executions of the group run at once, and at most
        ``lease_rate_limit`` (``"10/s"``) start, across every worker; the group is
        ``lease_limit_key`` (given like ``lease_key``) or the task's name. A delivery over
        the limit waits on the store, its message acked (``lease_celery.limits``).

    Inside the body, ``self.lease`` is the :class:`~lease_celery.runtime.handle.LeaseHandle`
    (``token``, ``owner``, ``check()``).
    """

    # The options a task may set, each from its row of the settings table: None (unset: the
    # app's setting, else the default) or, for an option only a task has, its default.
    vars().update(task_attributes())
    #: Marks leased tasks for the modules under the gate (``lease_celery.apps.is_leased``).
    __lease_celery_task__: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Refuse bad options when the task is defined, not when the first message arrives.
        where = f"task {cls.__dict__.get('name') or cls.__name__}"
        for setting in SETTINGS:
            if not setting.on_task:
                continue
            value = cls.__dict__.get(setting.name)
            if setting.kind is KEY_SPEC:
                if inspect.isfunction(value):
                    # A plain function stored on a class would be bound as a method and get
                    # the task as its first argument; a key callable receives the task's
                    # arguments only.
                    setattr(cls, setting.name, staticmethod(value))
                if setting.name in cls.__dict__ or "run" in cls.__dict__:
                    # The format string's fields are checked against the body's parameters.
                    check_key_spec(getattr(cls, setting.name), body_signature(cls), where=where,
                                   name=setting.name)
            elif value is not None:
                setting.parse(value, f"{setting.name} of {where}")
        own = cls.__dict__.get("after_return")
        if own is not None and not getattr(own, "lease_celery_settles", False):
            cls.after_return = _settling_after_return(own)  # type: ignore[method-assign]

    @classmethod
    def on_bound(cls, app: Any) -> None:
        # Binding happens when the app is finalized: in a worker, before worker_init (Celery
        # lists the tasks' modules first), so the worker's receivers are connected in time.
        install()
        cls._resolve_lease_settings(app)

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None,
                    *more: Any, lease_unique: bool | None = None,
                    lease_record: bool | None = None, **options: Any) -> Any:
        """Celery's ``apply_async``; with ``lease_unique`` (this call's, else the task's), a
        key that already has a holder is not published again (``lease_celery.execution.unique``);
        with ``lease_record`` (this call's, else ``lease_record_at_publish``), the key's row is
        written before the message goes out (``lease_celery.execution.published``)."""
        unique = self.lease_unique if lease_unique is None else lease_unique
        record = (self.lease_settings.record_at_publish if lease_record is None
                  else lease_record)
        if (record and not self.app.conf.task_always_eager
                and (task_id is None or task_id != self.request.id)):
            # Not for a retry (the holder publishing itself again): its row exists.
            task_id = task_id or uuid.uuid4().hex
            key = record_at_publish(self, args, kwargs, task_id, options)
            if key is not None:
                try:
                    return super().apply_async(args, kwargs, task_id, *more, **options)
                except Exception as exc:  # the caller hears of it: no run behind its back
                    withdraw(self, key, task_id, f"its publish failed ({exc!r})")
                    raise
            if not unique:
                return super().apply_async(args, kwargs, task_id, *more, **options)
        if unique:
            holder = existing_holder(self, args, kwargs, task_id)
            if holder is not None:
                return holder
        return super().apply_async(args, kwargs, task_id, *more, **options)

    # -- public API inside the body ---------------------------------------------------------

    @property
    def lease(self) -> LeaseHandle:
        """The lease this execution holds; ``LeaseError`` outside a LeasedTask body."""
        execution = getattr(self.request, "lease", None)
        if not isinstance(execution, Execution):
            raise LeaseError("self.lease is only available inside a LeasedTask body")
        return execution.view

    def effect(self, key: str, payload: Any, fn: Callable[[str], Any], *,
               retry_same_key: bool = False, wait: float = 0.0) -> Any:
        """Perform an outside action at most once per business ``key``; replays return the
        recorded result. ``fn`` receives the key (pass it on as the target's idempotency key).
        See :meth:`lease_celery.effects.Effects.once`."""
        return self.lease.effect(key, payload, fn, retry_same_key=retry_same_key, wait=wait)

    @property
    def lease_store(self) -> Store:
        """The store this task's leases live in (one per process per URL)."""
        return shared_store(self.lease_settings.store_url)

    def after_return(self, status: str, retval: Any, task_id: str, args: Any, kwargs: Any,
                     einfo: Any) -> None:
        """Celery stored the outcome (and sent the callbacks): end the settle phase.

        A subclass's own ``after_return`` is wrapped so that this runs first, whether or not
        it calls ``super()``.
        """
        confirm_stored(getattr(self.request, "lease", None), status)

    def on_replace(self, sig: Any) -> Any:
        """Celery's ``replace()``: a replacement that runs on this key gets it first, with no
        attempt counted (``attempts._hand_on_to_replacement``); then Celery publishes it."""
        handle = getattr(self.request, "lease", None)
        if isinstance(handle, Execution):
            self.request.lease_replaced = True
            self._hand_on_to_replacement(handle, sig)
        return super().on_replace(sig)

    # -- the gate ---------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.request.called_directly:
            return self._gate(args, kwargs)
        # A direct call (``task(...)``) pushes no request: give it one of its own, so that
        # threads calling the task at once do not share Celery's default request (and lease).
        self.push_request(args=args, kwargs=kwargs, called_directly=True)
        try:
            return self._gate(args, kwargs)
        finally:
            self.pop_request()

    def _gate(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        request = self.request
        settings = self.lease_settings
        store = self.lease_store
        # A direct call has no delivery id; it is still the protected work, so it runs under a
        # lease too, on a key of its own unless lease_key names one.
        task_id = request.id or (f"direct:{uuid.uuid4()}" if request.called_directly else None)
        key = resolve_key(self.lease_key, self.run, args, kwargs, task_id=task_id)
        heartbeat = Heartbeat.for_process()
        # A short outage is waited out (about a ttl) rather than re-published at once.
        wait = self._store_wait(settings, key)
        try:
            handle = retrying(lambda: self._claim(store, key, settings, args, kwargs), wait)
        except StoreError as exc:
            # The store still cannot answer: keep the delivery rather than fail and ack it.
            self._defer(key, min(settings.ttl, STORE_RETRY_DELAY), settings, args, kwargs,
                        why=deferral_reason(wait, exc), eager_error=exc,
                        recovery=True)
        except _SettlementTaken as taken:
            request.lease = taken.handle
            heartbeat.watch(taken.handle)  # renews the completer's settle deadline
            freeze_links(request)
            return taken.outcome()
        except Answer as answer:
            return self._answer(answer, settings, args, kwargs, heartbeat)
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
            result = self.run(*args, **kwargs)
        except BaseException as exc:
            heartbeat.unwatch(handle)
            self._after_error(handle, exc, settings)
            raise
        handle.body_returned(time.monotonic() - started)
        return self._finish(handle, result, settings, args, kwargs, heartbeat)

    # -- before the body --------------------------------------------------------------------

    def _claim(self, store: Store, key: str, settings: LeaseSettings,
               args: Any, kwargs: Any, *, answering: bool = False) -> Execution:
        owner = execution_owner()
        request = self.request
        info = None if request.called_directly else task_info(self, request, args, kwargs)
        heartbeat = Heartbeat.for_process()
        # An answer's key is no work of the group: it runs no body.
        limit = None if answering else group_of(self, settings, args, kwargs)
        for _ in range(CLAIM_ROUNDS):
            # The heartbeat knows the claim before it is sent: under a green pool a busy
            # neighbour may hold the reply past the ttl, and it then renews the row meanwhile.
            claim = heartbeat.claiming(store, key, owner, ttl=settings.ttl,
                                       heartbeat_interval=settings.heartbeat_interval)
            lease: Lease | LimitRefused | None
            # A previous delivery's finish behind its return, carried in this claim's own
            # transaction (execution.background): one commit for both.
            carried = None if limit is not None else heartbeat.take_carried(store)
            try:
                if isinstance(carried, CarriedFinish):
                    lease = self._claim_carrying(store, carried, key, owner, settings.ttl,
                                                 info)
                elif limit is None:
                    lease = store.claim(key, owner=owner, ttl=settings.ttl, task=info)
                else:
                    # An eager call has no message to park: without task info it is refused
                    # and raises (LimitReached).
                    lease = store.claim_limited(
                        key, owner=owner, ttl=settings.ttl, limit=limit,
                        task=None if self.request.is_eager else info)
            except BaseException:
                heartbeat.claimed(claim, None)
                raise
            if isinstance(lease, LimitRefused):
                heartbeat.claimed(claim, None)
                self._limit_refused(store, key, lease, settings, args, kwargs)
            if lease is not None:
                return self._admit(store, lease, settings, claim, heartbeat)
            heartbeat.claimed(claim, None)
            record = store.get(key)
            if record is None:
                continue  # purged between our claim and our look: claim again
            if (record.settling and record.task_id == self.request.id
                    and not (self.request.is_eager or self.request.called_directly)):
                self._complete(store, record, owner, settings, args, kwargs)
                continue  # another delivery took the settlement first: look again
            if record.state in (LeaseState.DONE, LeaseState.DEAD):
                if (not answering and record.task_id != self.request.id
                        and not (self.request.is_eager or self.request.called_directly)):
                    # Done under another task id: this delivery gets its own answer (see
                    # answers.py), claimed like any work on a key of its own.
                    raise Answer(self._claim(store, answer_key(key, self.request.id),
                                             settings, args, kwargs, answering=True), record)
                logger.info("lease %s is %s (token %s): delivery %s ignored",
                            key, record.state.value, record.token, self.request.id)
                signals.duplicate_ignored.send(sender=self, key=key, state=record.state.value,
                                               record=record)
                if self.request.called_directly:
                    # The caller gets no result and no run: say why, not a bare Ignore.
                    raise _finished_already(record)
                if self.request.is_eager:
                    raise _AlreadyDone(record)  # the eager caller gets the accepted outcome
                raise Ignore()
            now = store.now()
            if record.state is LeaseState.READY:
                if record.not_before is None or record.not_before <= now:
                    continue  # released between our claim and our look: claim again
                backing_off = LeaseHeld(f"lease {key!r} is backing off for another "
                                        f"{record.not_before - now:.1f}s after: {record.reason}")
                self._defer(key, record.not_before - now, settings, args, kwargs,
                            why=str(backing_off), eager_error=backing_off)
            remaining = (record.expires_at or 0.0) - now
            if remaining > 0:
                held = LeaseHeld(f"lease {key!r} is held by {record.owner} (token "
                                 f"{record.token}) for another {remaining:.1f}s")
                self._defer(key, remaining, settings, args, kwargs, holder=record.owner,
                            why=str(held), eager_error=held)
        # Lost the race several times in a row (expiries and takeovers crossing ours).
        contended = LeaseHeld(f"lease {key!r}: {CLAIM_ROUNDS} claims in a row lost a race")
        self._defer(key, 0.0, settings, args, kwargs, why=str(contended), eager_error=contended)

    @staticmethod
    def _claim_carrying(store: Store, finishing: CarriedFinish, key: str, owner: str,
                        ttl: float, info: Any) -> Lease | None:
        """The claim of ``key`` carrying a previous delivery's finish (``take_carried``): its
        verdict goes to that delivery (its signals, with its request); if the store fails,
        a sender writes the finish alone and the claim's failure is this delivery's."""
        try:
            accepted, lease = store.finish_and_claim(finishing.lease, finishing.encoded, key,
                                                     owner=owner, ttl=ttl, task=info)
        except BaseException:
            finishing.give_back()
            raise
        finishing.done(accepted)
        return lease

    def _limit_refused(self, store: Store, key: str, refusal: LimitRefused,
                       settings: LeaseSettings, args: Any, kwargs: Any) -> NoReturn:
        """The group refused: a parked delivery is acked (``Ignore``: it waits on the
        store, holding no pool process); one over the rate, or that could not be parked,
        comes back at the group's next allowed start."""
        if refusal.parked:
            note_wait(self, key, refusal)
            raise Ignore()
        reached = LimitReached(f"lease {key!r}: {describe(refusal)}")
        self._defer(key, refusal_delay(refusal, settings, store.now()), settings, args,
                    kwargs, why=str(reached), eager_error=reached, jitter=False)

    def _complete(self, store: Store, record: LeaseRecord, owner: str,
                  settings: LeaseSettings, args: Any, kwargs: Any) -> None:
        """This very task id is done (or dead) and still settling: Celery may not have stored
        its outcome. While its owner's settle deadline lasts, the owner is alive and settles it:
        come back after the deadline. Past it, the owner is gone: take the settlement over and
        complete the key (raises ``_SettlementTaken``); returns if another delivery took it
        first."""
        remaining = (record.expires_at or 0.0) - store.now()
        if remaining > 0:
            settling = LeaseHeld(f"lease {record.key!r} is {record.state.value}; its owner "
                                 f"{record.owner} settles it for another {remaining:.1f}s")
            self._defer(record.key, remaining, settings, args, kwargs, holder=record.owner,
                        why=str(settling), eager_error=settling)
        sent_at = time.monotonic()  # before the write: the local deadline never outlives it
        lease = store.claim_settlement(record.key, owner=owner, ttl=settings.ttl)
        if lease is None:
            return
        if record.state is LeaseState.DONE and self._success_stored():
            # The owner was slow, not dead: Celery stored its SUCCESS, and sends callbacks
            # before it stores a success, so only the confirmation is missing. Writing the
            # outcome again would be a second result write by a live pair of workers.
            logger.info("lease %s is done and Celery stored the outcome of task %s: delivery "
                        "%s confirms the settlement (token %s)", record.key, self.request.id,
                        self.request.id, lease.token)
            store.settle(lease)
            raise Ignore()
        logger.warning("lease %s is %s but its owner %s died before Celery stored the outcome:"
                       " delivery %s completes it (token %s)", record.key, record.state.value,
                       record.owner, self.request.id, lease.token)
        signals.settle_completed.send(sender=self, key=record.key, lease=lease,
                                      state=record.state.value)
        handle = Execution(lease, store=store, ttl=settings.ttl,
                             heartbeat_interval=settings.heartbeat_interval,
                             sent_at=sent_at, task=self)
        handle.enter(Phase.SETTLING)
        raise _SettlementTaken(handle, record)

    @property
    def backend(self) -> Any:
        """Celery's result backend; for an owner whose settle deadline passed on its own clock
        (it stalled before Celery stored the outcome), behind ``SettlementCheck``. Otherwise
        the backend itself: the normal path costs nothing."""
        backend = self._result_backend
        handle = getattr(self.request, "lease", None)
        if isinstance(handle, Execution) and handle.settling_past_deadline():
            return SettlementCheck(backend, handle)
        return backend

    @backend.setter
    def backend(self, value: Any) -> None:
        self._backend = value

    def _success_stored(self) -> bool:
        """Does Celery's result backend hold this task id's SUCCESS? (False when results are
        not stored, or the backend cannot say.)"""
        if self.request.is_eager or getattr(self.request, "ignore_result", False) \
                or self.ignore_result or isinstance(self._result_backend, RPCBackend):
            return False  # rpc:// answers PENDING inside a worker: it cannot tell
        try:
            return bool(self.AsyncResult(self.request.id).state == "SUCCESS")
        except Exception:  # a backend that cannot answer: complete as if nothing was stored
            logger.debug("lease_celery: the result backend could not say whether task %s "
                         "succeeded", self.request.id, exc_info=True)
            return False

    def _admit(self, store: Store, lease: Lease, settings: LeaseSettings, claim: InFlight,
               heartbeat: Heartbeat) -> Execution:
        """A claim succeeded: run it, unless the policy says the key has had enough."""
        handle = Execution(lease, store=store, ttl=settings.ttl,
                             heartbeat_interval=settings.heartbeat_interval,
                             sent_at=claim.sent_at, task=self)
        # Watched before anything here may yield (a signal receiver, a log handler), and
        # given whatever the heartbeat renewed while the reply waited unread.
        heartbeat.watch(handle)
        heartbeat.claimed(claim, handle)
        logger.info("lease %s acquired by %s with token %s (attempt %s, takeovers %s)",
                    lease.key, lease.owner, lease.token, lease.attempts, lease.takeovers)
        signals.lease_acquired.send(sender=self, key=lease.key, lease=lease)
        if lease.takeovers:
            signals.lease_taken_over.send(sender=self, key=lease.key, lease=lease)
        if lease.cancel is not None:
            heartbeat.unwatch(handle)  # _kill watches it again if the failure settles
            # Cancelled while its holder was gone: this delivery never runs the body.
            self._kill(handle, lease.cancel)
            raise LeaseCancelled(f"lease {lease.key!r} was {lease.cancel}")
        reason = settings.policy.on_claim(attempts=lease.attempts, takeovers=lease.takeovers)
        if reason is not None:
            heartbeat.unwatch(handle)
            self._kill(handle, reason)
            raise LeaseDead(f"lease {lease.key!r} is dead: {reason}")
        return handle

    def _answer(self, answer: Answer, settings: LeaseSettings, args: Any, kwargs: Any,
                heartbeat: Heartbeat) -> Any:
        """Answer a duplicate with the accepted outcome of the key it duplicates, under its
        own answer lease: Celery stores it under this delivery's id and sends this delivery's
        callbacks and chord part, as if the body had run."""
        handle, record = answer.handle, answer.record
        self.request.lease = handle
        freeze_links(self.request)
        logger.info("lease %s is %s under task %s: delivery %s answered with its outcome "
                    "(answer key %s, token %s)", record.key, record.state.value,
                    record.task_id, self.request.id, handle.key, handle.token)
        signals.duplicate_answered.send(sender=self, key=record.key, state=record.state.value,
                                        record=record, lease=handle.lease)
        if record.state is LeaseState.DEAD:
            heartbeat.unwatch(handle)  # _kill watches it again if the failure settles
            self._kill(handle, record.reason or "dead")
            raise LeaseDead(f"lease {record.key!r} is dead: {record.reason}")
        heartbeat.watch(handle)
        return self._finish(handle, record.result, settings, args, kwargs, heartbeat)

    # -- after the body ---------------------------------------------------------------------

    def _finish(self, handle: Execution, result: Any, settings: LeaseSettings, args: Any,
                kwargs: Any, heartbeat: Heartbeat) -> Any:
        # Still watched: if the finish is accepted, the heartbeat renews the settle deadline
        # until Celery has stored the result (after_return).
        if handle.cancelled is not None:
            # The body returned after the cancel reached it: the cancel wins, as if check()
            # had raised at the end.
            heartbeat.unwatch(handle)
            self._kill(handle, handle.cancelled)
            raise LeaseCancelled(f"lease {handle.key!r} was {handle.cancelled}")
        settle_within = self._settle_within(settings)
        # The row keeps the result as Celery's backend stores it (a GroupResult as its tuple
        # form): a result Celery can store, the lease store can keep.
        stored = (self._result_backend.prepare_value(result) if isinstance(result, ResultBase)
                  else result)
        request = self.request
        mode = settings.finish_mode(handle.body_seconds,
                                    store_carries=handle.store.carries_finish)
        if (settle_within is None and mode != "inline"
                and handle.lease.group is None  # its waiters are handed on from here
                and not (request.is_eager or request.called_directly)):
            # Nothing Celery does next depends on the verdict: write it behind the return.
            try:
                finish_in_background(self, handle, stored, heartbeat,
                                     carried=mode == "carried")
            except ResultNotSerializable as exc:
                heartbeat.unwatch(handle)
                self._after_error(handle, exc, settings)
                raise
            return result
        # As the claim does, the finish waits out a short outage.
        wait = self._store_wait(settings, handle.key, step="the finish of")
        try:
            accepted = Completion(self, handle).finish(stored, settle_within=settle_within,
                                                       wait=wait)
        except ResultNotSerializable as exc:
            heartbeat.unwatch(handle)
            self._after_error(handle, exc, settings)
            raise
        except StoreError as exc:
            # Not recorded, so not accepted: run again later rather than report an unfenced
            # success or fail and ack (which would lose the work).
            heartbeat.unwatch(handle)
            self._release(handle, reason=f"finish failed in the lease store: {exc}")
            self._defer(handle.key, min(settings.ttl, STORE_RETRY_DELAY), settings, args, kwargs,
                        why=deferral_reason(wait, exc, failed="finish failed in the lease store"),
                        eager_error=exc, recovery=True)
        if not accepted:
            self._not_current(handle, "finish refused: the lease expired or was taken over")
        return result



def _finished_already(record: LeaseRecord) -> LeaseError:
    """What a direct call of a key that is done (or dead) raises instead of running it."""
    if record.state is LeaseState.DEAD:
        return LeaseDead(f"lease {record.key!r} is dead with token {record.token} "
                         f"({record.reason}): the call did not run it; requeue the key to run "
                         "it again")
    return LeaseDone(f"lease {record.key!r} is done with token {record.token}: the call did "
                     f"not run it again (its accepted result is the row's: "
                     f"store.get({record.key!r}).result); purge the key to run it again")


def _settling_after_return(own: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a subclass's ``after_return`` so the settle phase ends first, always."""

    @functools.wraps(own)
    def after_return(self: LeasedTask, status: str, *args: Any, **kwargs: Any) -> Any:
        confirm_stored(getattr(self.request, "lease", None), status)
        return own(self, status, *args, **kwargs)

    after_return.lease_celery_settles = True  # type: ignore[attr-defined]
    return after_return
