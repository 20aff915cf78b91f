"""How a delivery's attempt ends when it did not simply finish: deferred, retried, released,
dead or refused.

``Ending`` serves the gate (``gate``: claim, body, finish) for one delivery. Every path here
keeps the three promises: a refused (stale) outcome never reaches the result backend
(``Ignore``); work nobody else will do is re-published, never acked and forgotten; a
``LeaseLost`` is never the task's failure; and a key that ends ``dead`` settles its failure
like a finish. The writes themselves, and their verdicts, are the completion's.
"""

from __future__ import annotations

import logging
import math
import random
from typing import Any, NoReturn

from celery import Task
from celery.app.task import get_actual_ignore_result
from celery.backends.base import DisabledBackend
from celery.exceptions import Ignore, Reject, Retry

from .. import signals
from ..errors import LeaseCancelled, LeaseLost, StoreError
from ..runtime.execution import Execution
from ..settings import LeaseSettings
from .answers import stored_failure
from .completion import Completion
from .delivery import republish_later
from .outage import StoreWait
from .outcome import End, Outcome, decide, retry_message
from .replaced import replacement_message

__all__ = ["Ending", "result_backend"]

logger = logging.getLogger(__name__)


def result_backend(task: Any) -> Any:
    """Celery's result backend of ``task`` itself (``LeasedTask.backend`` may put a check in
    front of it)."""
    return Task.backend.fget(task)


class Ending:
    """The ways out of the gate for one delivery of ``task``, under its ``settings``."""

    def __init__(self, task: Any, settings: LeaseSettings) -> None:
        self.task, self.settings = task, settings

    @property
    def request(self) -> Any:
        """The delivery being run (Celery's request context of the task)."""
        return self.task.request

    def settle_within(self, *, failed: bool = False) -> float | None:
        """How long the owner has to confirm that Celery stored the outcome; None when Celery
        does nothing after the lease's outcome, so the key settles at once: an eager or direct
        call (the caller gets the outcome itself), or a result Celery will not store with no
        callback, chain step or chord to send (the commonest fire-and-forget task: no settle
        write at all)."""
        request = self.request
        if request.is_eager or request.called_directly:
            return None
        ignored = bool(get_actual_ignore_result(self.task, request)) or isinstance(
            result_backend(self.task), DisabledBackend)
        if failed:
            stores = not ignored or bool(self.task.store_errors_even_if_ignored)
            sends = bool(request.errbacks or request.chord)
        else:
            stores = not ignored
            sends = bool(request.callbacks or request.chain or request.chord)
        return self.settings.ttl if stores or sends else None

    def store_wait(self, key: str, *, step: str = "delivery") -> StoreWait | None:
        """How this delivery waits for an unavailable store (``outage``: about a ttl); None for
        an eager or direct call, whose caller hears of the failure at once."""
        request = self.request
        if request.is_eager or request.called_directly:
            return None
        return StoreWait(self.task, self.settings.ttl, key, step=step)

    def defer(self, key: str, remaining: float, args: Any, kwargs: Any, *, why: str,
              eager_error: Exception, holder: str | None = None, recovery: bool = False,
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
        countdown = min(max(remaining, 0.05), max(self.settings.ttl, remaining))
        if jitter:  # (a rate's deferral is spread over its own interval: execution.limited)
            countdown += random.uniform(0, self.settings.ttl / 10)
        republish_later(self.task, args, kwargs, countdown, recovery=recovery)
        # Said before Celery's own "Task … ignored" for this message (Ignore acks it), so the
        # reader knows the work was re-published, not dropped.
        logger.info("delivery %s of %s re-published to run again in %.2fs (%s); this copy is "
                    "acked, and Celery logs it as ignored", request.id, key, countdown, why)
        signals.duplicate_deferred.send(sender=self.task, key=key, countdown=countdown,
                                        holder=holder, reason=why)
        raise Ignore()

    def after_error(self, handle: Execution, exc: BaseException) -> None:
        """The body (or finish) raised: apply what ``outcome.decide`` makes of it.

        Raises ``Ignore`` when the lease was lost meanwhile (a stale failure must not overwrite
        the new owner's outcome), ``Retry`` for the lease's own error retries
        (``lease_retry_errors``); returns when ``exc`` should propagate as it is.
        """
        request = self.request
        outcome = decide(
            exc, policy=self.settings.policy, attempts=handle.lease.attempts,
            cancelled=handle.cancelled,
            lost=handle.lost is not None, replaced=bool(getattr(request, "lease_replaced", False)),
            retry_time_limits=self.settings.retry_time_limits, soft_limit=self._soft_limit(),
            autoretry_for=tuple(getattr(self.task, "autoretry_for", ()) or ()),
            celery_retries_exhausted=bool(getattr(request, "celery_retries_exhausted", False)),
            eager=bool(request.is_eager))
        end, reason = outcome.end, outcome.reason
        if end is End.CANCELLED:
            self.kill(handle, reason)
            if isinstance(exc, (Retry, Ignore, Reject)):
                raise LeaseCancelled(f"lease {handle.key!r} was {reason}") from exc
        elif end is End.RETRY:
            # Ready again when Celery's retry is due, with the retry's message on the row: a
            # sweeper re-publishes that one, not the failed attempt, and not before it is due.
            message = retry_message(exc) if isinstance(exc, Retry) else None
            self.release(handle, reason=reason, delay=outcome.delay, task=message,
                         counted=False)
        elif end is End.REPLACED:
            if not getattr(request, "lease_handed_on", False):
                # The replacement runs on no lease of this key: the key's work is handed out.
                self.end_done(handle, reason)
        elif end is End.REQUEUED:
            self.release(handle, reason=reason)
        elif end is End.REJECTED:
            self.kill(handle, reason, settles=False)
        elif end is End.IGNORED:
            self.end_done(handle, reason)
        elif end is End.TERMINATED:
            self.release(handle, reason=reason, passing=True)
        elif end is End.LOST:
            # Never the task's failure. If the store still held the lease (lost only by this
            # process's reckoning: renewal replies came back late), the release is accepted
            # and the work runs again; if not, release -> not_current decides.
            if self.release(handle, reason=reason):
                lost = exc if isinstance(exc, Exception) else LeaseLost(reason)
                self.defer(handle.key, 0.0, request.args or (), request.kwargs or {},
                           eager_error=lost, recovery=True,
                           why=f"lease lost before the store expired it: {exc}")
        elif end is End.FAIL:
            self.kill(handle, reason, error=stored_failure(exc))
        else:
            self._back_off(handle, exc, outcome)

    def _back_off(self, handle: Execution, exc: BaseException, outcome: Outcome) -> None:
        """``lease_retry_errors``: release with the backoff and retry through Celery."""
        request = self.request
        if request.called_directly:
            self.release(handle, reason=outcome.reason, delay=outcome.delay)
            return  # a plain call has no delivery to retry: the error propagates
        # Publish the retry first: if that fails, the key stays held until it expires and the
        # sweeper brings the task back, instead of being left ready with no message for it.
        # The lease policy, not the task's max_retries, bounds these retries.
        retry = self.task.retry(exc=exc, countdown=outcome.delay, max_retries=math.inf,
                                throw=False)
        self.release(handle, reason=outcome.reason, delay=outcome.delay,
                     task=retry_message(retry))
        Completion(self.task, handle).retrying(outcome.reason, delay=outcome.delay)
        raise retry

    def hand_on_to_replacement(self, handle: Execution, replacement: Any) -> None:
        """``replace()``: a replacement that runs on this very key (Celery gives it this task's
        id) gets the key now, before it is published (a live holder would only defer it): the
        row is ready with the replacement's message, and the attempt is given back."""
        if self.request.is_eager or self.request.called_directly:
            return
        message = replacement_message(self.task, handle.key, replacement)
        if message is None:
            return
        if self.release(handle, reason="replaced by a new task", task=message, counted=False):
            self.request.lease_handed_on = True

    def end_done(self, handle: Execution, reason: str) -> None:
        """End the key done with no result, settled at once (Celery stores nothing for it)."""
        try:
            accepted = Completion(self.task, handle).finish(None, settle_within=None, wait=None)
        except StoreError:
            logger.exception("lease %s token %s: could not end it (%s); the lease will expire "
                             "at %s", handle.key, handle.token, reason, handle.lease.expires_at)
            return
        if not accepted:
            self.not_current(handle, f"the attempt ended after its lease lapsed ({reason})")

    def release(self, handle: Execution, *, reason: str, delay: float = 0.0,
                passing: bool = False, task: Any = None, counted: bool = True) -> bool:
        """Give the key back (after ``delay``; ``task``: the message that claims it next;
        ``counted=False``: the attempt given back, see ``Store.release``). If the lease is no
        longer current, this attempt's failure is not the key's outcome: see ``not_current``
        (skipped when ``passing`` an exit through, which must go on)."""
        released = Completion(self.task, handle).release(reason, delay=delay, message=task,
                                                    counted=counted)
        if released is False and not passing:
            self.not_current(handle, f"the attempt failed after its lease lapsed ({reason})")
        return bool(released)

    def _soft_limit(self) -> Any:
        limits = getattr(self.request, "timelimit", None) or (None, None)
        return limits[1] or self.task.soft_time_limit or self.task.app.conf.task_soft_time_limit

    def kill(self, handle: Execution, reason: str, *, settles: bool = True,
             error: Any = None) -> None:
        """Mark the key dead (of ``error``, see ``Completion.kill``); the failure then settles
        like a finish (after_return), unless Celery stores nothing for it (``settles=False``:
        a rejected task)."""
        settle_within = self.settle_within(failed=True) if settles else None
        if Completion(self.task, handle).kill(reason, settle_within=settle_within,
                                         error=error) is False:
            self.not_current(handle, f"the attempt failed after its lease lapsed ({reason})")

    def not_current(self, handle: Execution, reason: str) -> NoReturn:
        """This execution's outcome was refused: its lease is no longer current.

        If another owner has the key (or settled it), the outcome is stale: dropped with
        ``Ignore``, so it never reaches the result backend or callbacks. If nobody took over
        (the lease just lapsed, or an operator released it), dropping it would lose the work:
        the delivery is re-published to run again, then acked.
        """
        taken = Completion(self.task, handle).refused(reason)
        if taken or self.request.is_eager or self.request.called_directly:
            raise Ignore()
        self.defer(handle.key, 0.0, self.request.args or (), self.request.kwargs or {},
                   why=f"nobody took the key over: {reason}", eager_error=LeaseLost(reason),
                   recovery=True)
