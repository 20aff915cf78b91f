"""LeasedTask: the only module that touches Celery's Task API.

The lease gate lives in ``__call__`` (signal receivers cannot stop a task). The worker calls
``__call__`` with the request already pushed, so ``self.request`` is the delivery being run; we
call ``self.run`` ourselves, never ``super().__call__``, which would push a fresh request.
"""

from __future__ import annotations

import functools
import inspect
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar, NoReturn

from celery import Task
from celery.exceptions import Ignore

from . import signals
from .errors import LeaseError, LeaseHeld, ResultNotSerializable, StoreError
from .handle import LeaseHandle
from .heartbeat import Heartbeat
from .identity import process_owner
from .keys import KeySpec, check_key_spec, resolve_key
from .models import LeaseState
from .settings import LeaseSettings, resolve_settings
from .stores.base import Store, check_ttl, open_store

__all__ = ["LeasedTask"]

logger = logging.getLogger(__name__)

#: How many times a delivery re-tries a claim that raced with a release or an expiry.
CLAIM_ROUNDS = 3
#: Seconds (at most ttl) before a delivery that met an unavailable store runs again.
STORE_RETRY_DELAY = 5.0

_stores: dict[str, Store] = {}
_stores_lock = threading.Lock()


def _shared_store(url: str) -> Store:
    """One store object per URL per process (the store itself reconnects after fork)."""
    with _stores_lock:
        store = _stores.get(url)
        if store is None:
            store = _stores[url] = open_store(url)
        return store


class LeasedTask(Task):  # type: ignore[misc]  # celery ships no type information
    """A Celery task whose body runs under a fenced, heartbeated lease.

    Options (task attributes, or ``@app.task(..., lease_key=...)``):

    ``lease_key``
        ``"report:{report_id}"`` (format string over the arguments), a callable, or ``None``
        (the task id).
    ``lease_ttl``, ``lease_heartbeat_interval``, ``lease_store_url``
        Override the ``lease_*`` Celery settings for this task.

    Inside the body, ``self.lease`` is the :class:`~lease_celery.handle.LeaseHandle`
    (``token``, ``owner``, ``check()``).
    """

    lease_key: ClassVar[KeySpec] = None
    lease_ttl: ClassVar[float | None] = None
    lease_heartbeat_interval: ClassVar[float | None] = None
    lease_store_url: ClassVar[str | None] = None

    _lease_settings: ClassVar[LeaseSettings | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Refuse bad options when the task is defined, not when the first message arrives.
        where = f"task {cls.__dict__.get('name') or cls.__name__}"
        spec = cls.__dict__.get("lease_key")
        if inspect.isfunction(spec):
            # A plain function stored on a class would be bound as a method and get the task
            # as its first argument; the key callable receives the task's arguments only.
            cls.lease_key = staticmethod(spec)
        if "lease_key" in cls.__dict__ or "run" in cls.__dict__:
            check_key_spec(cls.lease_key, _body_signature(cls), where=where)
        for name in ("lease_ttl", "lease_heartbeat_interval"):
            value = cls.__dict__.get(name)
            if value is not None:
                check_ttl(value, name=f"{name} of {where}")

    @classmethod
    def on_bound(cls, app: Any) -> None:
        # Binding happens when the app is finalized: at worker start at the latest.
        cls._lease_settings = resolve_settings(app, cls)

    # -- public API inside the body ---------------------------------------------------------

    @property
    def lease(self) -> LeaseHandle | None:
        """The lease this execution holds (``None`` outside the task body)."""
        return getattr(self.request, "lease", None)

    def effect(self, key: str, payload: Any, fn: Callable[[str], Any], *,
               retry_same_key: bool = False, wait: float = 0.0) -> Any:
        """Perform an outside action at most once per business ``key``; replays return the
        recorded result. ``fn`` receives the key (pass it on as the target's idempotency key).
        See :meth:`lease_celery.effects.Effects.once`."""
        handle = self.lease
        if handle is None:
            raise LeaseError("self.effect() is only available inside a LeasedTask body")
        return handle.effect(key, payload, fn, retry_same_key=retry_same_key, wait=wait)

    @property
    def lease_settings(self) -> LeaseSettings:
        settings = type(self)._lease_settings
        if settings is None:
            settings = type(self)._lease_settings = resolve_settings(self.app, type(self))
        return settings

    @property
    def lease_store(self) -> Store:
        """The store this task's leases live in (one per process per URL)."""
        return _shared_store(self.lease_settings.store_url)

    # -- the gate ---------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        settings = self.lease_settings
        store = self.lease_store
        # A direct call (``task(...)``) has no delivery id; it is still the protected work, so
        # it runs under a lease too, on a key of its own unless lease_key names one.
        task_id = request.id or (f"direct:{uuid.uuid4()}" if request.called_directly else None)
        key = resolve_key(self.lease_key, self.run, args, kwargs, task_id=task_id)
        try:
            handle = self._claim(store, key, settings, args, kwargs)
        except StoreError as exc:
            # The store cannot answer: keep the delivery rather than fail and ack it.
            self._defer(key, min(settings.ttl, STORE_RETRY_DELAY), settings, args, kwargs,
                        why=f"the lease store failed ({exc})", eager_error=exc)
        request.lease = handle
        heartbeat = Heartbeat.for_process()
        heartbeat.watch(handle)
        try:
            result = self.run(*args, **kwargs)
        except BaseException as exc:
            heartbeat.unwatch(handle)
            self._release_after_error(handle, exc)
            raise
        finally:
            if request.called_directly:
                request.lease = None  # the default request object outlives this call
        heartbeat.unwatch(handle)
        return self._finish(handle, result, args, kwargs)

    def _claim(self, store: Store, key: str, settings: LeaseSettings,
               args: Any, kwargs: Any) -> LeaseHandle:
        owner = process_owner()
        for _ in range(CLAIM_ROUNDS):
            sent_at = time.monotonic()
            lease = store.claim(key, owner=owner, ttl=settings.ttl)
            if lease is not None:
                logger.info("lease %s acquired by %s with token %s", key, owner, lease.token)
                signals.lease_acquired.send(sender=self, key=key, lease=lease)
                return LeaseHandle(lease, store=store, ttl=settings.ttl,
                                   heartbeat_interval=settings.heartbeat_interval,
                                   sent_at=sent_at, task=self)
            record = store.get(key)
            if record is None or record.state is LeaseState.READY:
                continue  # released between our claim and our look: claim again
            if record.state in (LeaseState.DONE, LeaseState.DEAD):
                logger.info("lease %s is %s (token %s): delivery %s ignored",
                            key, record.state.value, record.token, self.request.id)
                signals.duplicate_ignored.send(sender=self, key=key, state=record.state.value,
                                               record=record)
                raise Ignore()
            remaining = (record.expires_at or 0.0) - store.now()
            if remaining > 0:
                held = LeaseHeld(f"lease {key!r} is held by {record.owner} (token "
                                 f"{record.token}) for another {remaining:.1f}s")
                self._defer(key, remaining, settings, args, kwargs, holder=record.owner,
                            why=str(held), eager_error=held)
        # Lost the race several times in a row (expiries and takeovers crossing ours).
        contended = LeaseHeld(f"lease {key!r}: {CLAIM_ROUNDS} claims in a row lost a race")
        self._defer(key, 0.0, settings, args, kwargs, why=str(contended), eager_error=contended)

    def _defer(self, key: str, remaining: float, settings: LeaseSettings, args: Any,
               kwargs: Any, *, why: str, eager_error: Exception,
               holder: str | None = None) -> NoReturn:
        """Re-publish this delivery to run in about ``remaining`` seconds, then ack it.

        Used when a live holder has the key (acking a duplicate without re-publishing would
        lose the work if the holder died later) and when the store cannot answer.
        """
        request = self.request
        if request.is_eager or request.called_directly:  # nothing to re-publish to
            raise eager_error
        # Jitter spreads duplicates so they do not all come back in the same instant.
        countdown = min(max(remaining, 0.05), settings.ttl) + random.uniform(0, settings.ttl / 10)
        self.signature_from_request(request, args, kwargs, countdown=countdown).apply_async()
        logger.info("delivery %s of %s deferred by %.2fs: %s", request.id, key, countdown, why)
        signals.duplicate_deferred.send(sender=self, key=key, countdown=countdown, holder=holder,
                                        reason=why)
        raise Ignore()

    def _finish(self, handle: LeaseHandle, result: Any, args: Any, kwargs: Any) -> Any:
        store = handle.store
        try:
            accepted = store.finish(handle.lease, result)
        except ResultNotSerializable:
            self._release_after_error(handle, None)
            raise
        except StoreError as exc:
            # Not recorded, so not accepted: run again later rather than report an unfenced
            # success or fail and ack (which would lose the work).
            self._release_after_error(handle, exc)
            settings = self.lease_settings
            self._defer(handle.key, min(settings.ttl, STORE_RETRY_DELAY), settings, args, kwargs,
                        why=f"finish failed in the lease store ({exc})", eager_error=exc)
        if not accepted:
            self._reject_stale(handle, "finish refused: the lease expired or was taken over")
        logger.info("lease %s token %s finished", handle.key, handle.token)
        return result

    def _release_after_error(self, handle: LeaseHandle, exc: BaseException | None) -> None:
        """Give the key back so a retry can claim it; a failure of a stale lease is ignored."""
        try:
            released = handle.store.release(handle.lease)
            record = None if released else handle.store.get(handle.key)
        except StoreError:
            logger.exception("lease %s token %s: release after error failed; the lease will "
                             "expire at %s", handle.key, handle.token, handle.expires_at)
            return
        if released:
            signals.lease_released.send(sender=self, key=handle.key, lease=handle.lease)
            return
        if record is not None and (record.token != handle.token or record.owner != handle.owner):
            # Someone else owns the key now: our failure must not overwrite their outcome.
            self._reject_stale(handle, f"the body raised {exc!r} after the lease was taken over")

    def _reject_stale(self, handle: LeaseHandle, reason: str) -> None:
        handle.mark_lost(reason)
        logger.warning("lease %s owner %s token %s: stale outcome rejected: %s",
                       handle.key, handle.owner, handle.token, reason)
        signals.stale_result_rejected.send(sender=self, key=handle.key, lease=handle.lease,
                                           reason=reason)
        raise Ignore()


def _body_signature(cls: type) -> Callable[..., Any] | None:
    """The callable whose parameters a delivery's arguments bind to, or None if not defined.

    ``@app.task(bind=True)`` stores the function itself as ``run`` (first parameter: the task);
    without ``bind`` it stores a ``staticmethod``; a subclass may define ``def run(self, ...)``.
    """
    run = cls.__dict__.get("run")
    if run is None:
        return None
    if isinstance(run, staticmethod):
        return run.__func__
    return functools.partial(run, None)
