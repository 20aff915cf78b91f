"""How an attempt that did not simply finish ends: deferred, retried, released, dead or refused.

The base of :class:`~lease_celery.task.LeasedTask`, kept apart from the gate (``task.py``:
claim, body, finish) so each stays readable. Every path here keeps the three promises: a
refused (stale) outcome never reaches the result backend (``Ignore``); work nobody else will
do is re-published, never acked and forgotten; a ``LeaseLost`` is never the task's failure;
and a key that ends ``dead`` settles its failure like a finish.
"""

from __future__ import annotations

import logging
import math
import random
from typing import Any, ClassVar, NoReturn

from celery import Task
from celery.app.task import get_actual_ignore_result
from celery.backends.base import DisabledBackend
from celery.exceptions import Ignore, Reject, Retry

from .. import signals
from ..errors import LeaseCancelled, LeaseLost, StoreError
from ..keys import check_key_spec
from ..runtime.execution import Execution
from ..settings import LeaseSettings, resolve_settings
from .answers import stored_failure
from .completion import Completion
from .delivery import body_signature, republish_later
from .outage import StoreWait
from .outcome import End, Outcome, decide, retry_message
from .replaced import replacement_message

__all__ = ["AttemptEnding"]

logger = logging.getLogger(__name__)


class AttemptEnding(Task):  # type: ignore[misc]  # celery ships no type information
    """Deferral, retry, release, dead and stale refusal for LeasedTask (not a task itself)."""

    _lease_settings: ClassVar[LeaseSettings | None] = None

    @property
    def _result_backend(self) -> Any:
        """Celery's result backend itself (``LeasedTask.backend`` may put a check in front)."""
        return Task.backend.fget(self)

    @classmethod
    def _resolve_lease_settings(cls, app: Any) -> LeaseSettings:
        """Read the task's settings from ``app`` and keep them (the only place that does)."""
        settings = resolve_settings(app, cls)
        if isinstance(settings.limit_key, str) and "lease_limit_key" not in cls.__dict__:
            # The app-wide setting, checked against this task's parameters (a task's own
            # attribute was checked when the class was made).
            check_key_spec(settings.limit_key, body_signature(cls), name="lease_limit_key",
                           where=f"task {getattr(cls, 'name', None) or cls.__name__}")
        cls._lease_settings = settings
        return settings

    @property
    def lease_settings(self) -> LeaseSettings:
        """The task's settings, as resolved when it was bound (or now, if it never was)."""
        return self._lease_settings or self._resolve_lease_settings(self.app)

    def _settle_within(self, settings: LeaseSettings, *, failed: bool = False) -> float | None:
        """How long the owner has to confirm that Celery stored the outcome; None when Celery
        does nothing after the lease's outcome, so the key settles at once: an eager or direct
        call (the caller gets the outcome itself), or a result Celery will not store with no
        callback, chain step or chord to send (the commonest fire-and-forget task: no settle
        write at all)."""
        request = self.request
        if request.is_eager or request.called_directly:
            return None
        ignored = bool(get_actual_ignore_result(self, request)) or isinstance(
            self._result_backend, DisabledBackend)
        if failed:
            stores = not ignored or bool(self.store_errors_even_if_ignored)
            sends = bool(request.errbacks or request.chord)
        else:
            stores = not ignored
            sends = bool(request.callbacks or request.chain or request.chord)
        return settings.ttl if stores or sends else None

    def _store_wait(self, settings: LeaseSettings, key: str, *,
                    step: str = "delivery") -> StoreWait | None:
        """How this delivery waits for an unavailable store (``outage``: about a ttl); None for
        an eager or direct call, whose caller hears of the failure at once."""
        request = self.request
        if request.is_eager or request.called_directly:
            return None
        return StoreWait(self, settings.ttl, key, step=step)

    def _defer(self, key: str, remaining: float, settings: LeaseSettings, args: Any,
               kwargs: Any, *, why: str, eager_error: Exception,
               holder: str | None = None, recovery: bool = False,
               jitter: bool = True) -> NoReturn:
        """Re-publish this delivery to run in about ``remaining`` seconds, then ack it.

        Used when a live holder has the key (acking a duplicate without re-publishing would
        lose the work if the holder died later), while the key backs off, and, as recovered
        work ahead of new work (``recovery``), when the store cannot answer or the lease lapsed
        under this delivery.
        """
        request = self.request
        if request.is_eager or request.called_directly:  # nothing to re-publish to
            raise eager_error
        # Jitter spreads duplicates so they do not all come back in the same instant.
        countdown = min(max(remaining, 0.05), max(settings.ttl, remaining))
        if jitter:  # (a rate's deferral is spread over its own interval: execution.limited)
            countdown += random.uniform(0, settings.ttl / 10)
        republish_later(self, args, kwargs, countdown, recovery=recovery)
        logger.info("delivery %s of %s deferred by %.2fs: %s", request.id, key, countdown, why)
        signals.duplicate_deferred.send(sender=self, key=key, countdown=countdown, holder=holder,
                                        reason=why)
        raise Ignore()

    def _after_error(self, handle: Execution, exc: BaseException,
                     settings: LeaseSettings) -> None:
        """The body (or finish) raised: apply what ``outcome.decide`` makes of it.

        Raises ``Ignore`` when the lease was lost meanwhile (a stale failure must not overwrite
        the new owner's outcome), ``Retry`` for the lease's own error retries
        (``lease_retry_errors``); returns when ``exc`` should propagate as it is.
        """
        request = self.request
        outcome = decide(
            exc, policy=settings.policy, attempts=handle.lease.attempts, cancelled=handle.cancelled,
            lost=handle.lost is not None, replaced=bool(getattr(request, "lease_replaced", False)),
            retry_time_limits=settings.retry_time_limits, soft_limit=self._soft_limit(),
            autoretry_for=tuple(getattr(self, "autoretry_for", ()) or ()),
            celery_retries_exhausted=bool(getattr(request, "celery_retries_exhausted", False)),
            eager=bool(request.is_eager))
        end, reason = outcome.end, outcome.reason
        if end is End.CANCELLED:
            self._kill(handle, reason)
            if isinstance(exc, (Retry, Ignore, Reject)):
                raise LeaseCancelled(f"lease {handle.key!r} was {reason}") from exc
        elif end is End.RETRY:
            # Ready again when Celery's retry is due, with the retry's message on the row: a
            # sweeper re-publishes that one, not the failed attempt, and not before it is due.
            message = retry_message(exc) if isinstance(exc, Retry) else None
            self._release(handle, reason=reason, delay=outcome.delay, task=message,
                          counted=False)
        elif end is End.REPLACED:
            if not getattr(request, "lease_handed_on", False):
                # The replacement runs on no lease of this key: the key's work is handed out.
                self._end_done(handle, reason)
        elif end is End.REQUEUED:
            self._release(handle, reason=reason)
        elif end is End.REJECTED:
            self._kill(handle, reason, settles=False)
        elif end is End.IGNORED:
            self._end_done(handle, reason)
        elif end is End.TERMINATED:
            self._release(handle, reason=reason, passing=True)
        elif end is End.LOST:
            # Never the task's failure. If the store still held the lease (lost only by this
            # process's reckoning: renewal replies came back late), the release is accepted
            # and the work runs again; if not, _release -> _not_current decides.
            if self._release(handle, reason=reason):
                lost = exc if isinstance(exc, Exception) else LeaseLost(reason)
                self._defer(handle.key, 0.0, settings, request.args or (),
                            request.kwargs or {}, eager_error=lost, recovery=True,
                            why=f"lease lost before the store expired it: {exc}")
        elif end is End.FAIL:
            self._kill(handle, reason, error=stored_failure(exc))
        else:
            self._back_off(handle, exc, outcome)

    def _back_off(self, handle: Execution, exc: BaseException, outcome: Outcome) -> None:
        """``lease_retry_errors``: release with the backoff and retry through Celery."""
        request = self.request
        if request.called_directly:
            self._release(handle, reason=outcome.reason, delay=outcome.delay)
            return  # a plain call has no delivery to retry: the error propagates
        # Publish the retry first: if that fails, the key stays held until it expires and the
        # sweeper brings the task back, instead of being left ready with no message for it.
        # The lease policy, not the task's max_retries, bounds these retries.
        retry = self.retry(exc=exc, countdown=outcome.delay, max_retries=math.inf, throw=False)
        self._release(handle, reason=outcome.reason, delay=outcome.delay,
                      task=retry_message(retry))
        Completion(self, handle).retrying(outcome.reason, delay=outcome.delay)
        raise retry

    def _hand_on_to_replacement(self, handle: Execution, replacement: Any) -> None:
        """``replace()``: a replacement that runs on this very key (Celery gives it this task's
        id) gets the key now, before it is published (a live holder would only defer it): the
        row is ready with the replacement's message, and the attempt is given back."""
        if self.request.is_eager or self.request.called_directly:
            return
        message = replacement_message(self, handle.key, replacement)
        if message is None:
            return
        if self._release(handle, reason="replaced by a new task", task=message,
                         counted=False):
            self.request.lease_handed_on = True

    def _end_done(self, handle: Execution, reason: str) -> None:
        """End the key done with no result, settled at once (Celery stores nothing for it)."""
        try:
            accepted = Completion(self, handle).finish(None, settle_within=None, wait=None)
        except StoreError:
            logger.exception("lease %s token %s: could not end it (%s); the lease will expire "
                             "at %s", handle.key, handle.token, reason, handle.lease.expires_at)
            return
        if not accepted:
            self._not_current(handle, f"the attempt ended after its lease lapsed ({reason})")

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``retry``; noting when Celery's own ``max_retries`` ran out, so the key goes
        dead instead of being retried again by the lease policy."""
        try:
            return super().retry(*args, **kwargs)
        except Retry:
            raise
        except BaseException:
            self.request.celery_retries_exhausted = True
            raise

    def _release(self, handle: Execution, *, reason: str, delay: float = 0.0,
                 passing: bool = False, task: Any = None, counted: bool = True) -> bool:
        """Give the key back (after ``delay``; ``task``: the message that claims it next;
        ``counted=False``: the attempt given back, see ``Store.release``). If the lease is no
        longer current, this attempt's failure is not the key's outcome: see ``_not_current``
        (skipped when ``passing`` an exit through, which must go on)."""
        released = Completion(self, handle).release(reason, delay=delay, message=task,
                                                    counted=counted)
        if released is False and not passing:
            self._not_current(handle, f"the attempt failed after its lease lapsed ({reason})")
        return bool(released)

    def _soft_limit(self) -> Any:
        limits = getattr(self.request, "timelimit", None) or (None, None)
        return limits[1] or self.soft_time_limit or self.app.conf.task_soft_time_limit

    def _kill(self, handle: Execution, reason: str, *, settles: bool = True,
              error: Any = None) -> None:
        """Mark the key dead (of ``error``, see ``Completion.kill``); the failure then settles
        like a finish (after_return), unless Celery stores nothing for it (``settles=False``:
        a rejected task)."""
        settle_within = (self._settle_within(self.lease_settings, failed=True) if settles
                         else None)
        if Completion(self, handle).kill(reason, settle_within=settle_within,
                                         error=error) is False:
            self._not_current(handle, f"the attempt failed after its lease lapsed ({reason})")

    def _not_current(self, handle: Execution, reason: str) -> NoReturn:
        """This execution's outcome was refused: its lease is no longer current.

        If another owner has the key (or settled it), the outcome is stale: dropped with
        ``Ignore``, so it never reaches the result backend or callbacks. If nobody took over
        (the lease just lapsed, or an operator released it), dropping it would lose the work:
        the delivery is re-published to run again, then acked.
        """
        taken = Completion(self, handle).refused(reason)
        if taken or self.request.is_eager or self.request.called_directly:
            raise Ignore()
        self._defer(handle.key, 0.0, self.lease_settings, self.request.args or (),
                    self.request.kwargs or {}, why=f"nobody took the key over: {reason}",
                    eager_error=LeaseLost(reason), recovery=True)
