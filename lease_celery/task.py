"""LeasedTask: the adapter between Celery's Task API and the lease.

Its options, their checks when a task is defined, and Celery's hooks (``apply_async``,
``__call__``, ``retry``, ``on_replace``, ``after_return``, ``backend``) are here. Each
delivery's path through the lease is ``execution.gate`` (``__call__``: signal receivers
cannot stop a task), the ways an attempt ends ``execution.ending``, and the settle phase after
an accepted outcome ``execution.settle``.
"""

from __future__ import annotations

import functools
import inspect
import uuid
from collections.abc import Callable
from typing import Any, ClassVar

from celery import Task
from celery.exceptions import Retry

from .catalog import KEY_SPEC, SETTINGS, task_attributes
from .errors import ConfigError, LeaseError
from .execution.delivery import body_signature
from .execution.ending import Ending, result_backend
from .execution.gate import Gate
from .execution.outbox import enqueue
from .execution.published import record_at_publish, withdraw
from .execution.settle import SettlementCheck, confirm_stored
from .execution.unique import existing_holder
from .keys import check_key_spec
from .runtime.execution import Execution
from .runtime.handle import LeaseHandle
from .settings import LeaseSettings, resolve_settings
from .stores.base import Store
from .stores.registry import shared_store
from .wiring import install

__all__ = ["LeasedTask"]


class LeasedTask(Task):  # type: ignore[misc]  # celery ships no type information
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
    _lease_settings: ClassVar[LeaseSettings | None] = None

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

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None,
                    *more: Any, lease_unique: bool | None = None,
                    lease_record: bool | None = None, lease_transaction: Any = None,
                    **options: Any) -> Any:
        """Celery's ``apply_async``; with ``lease_unique`` (this call's, else the task's), a
        key that already has a holder is not published again (``lease_celery.execution.unique``);
        with ``lease_record`` (this call's, else ``lease_record_at_publish``), the key's row is
        written before the message goes out (``lease_celery.execution.published``); with
        ``lease_transaction`` (the app's connection), the row is written in its open
        transaction and the message goes out once it commits
        (``lease_celery.execution.outbox``)."""
        unique = self.lease_unique if lease_unique is None else lease_unique
        if lease_transaction is not None:
            if more:
                raise ConfigError("apply_async(..., lease_transaction=...): pass producer, "
                                  "link and the other options by name")
            return enqueue(self, lease_transaction, args, kwargs, task_id, options,
                           unique=unique)
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
        attempt counted (``Ending.hand_on_to_replacement``); then Celery publishes it."""
        handle = getattr(self.request, "lease", None)
        if isinstance(handle, Execution):
            self.request.lease_replaced = True
            Ending(self, self.lease_settings).hand_on_to_replacement(handle, sig)
        return super().on_replace(sig)

    # -- the gate ---------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.request.called_directly:
            return Gate(self, args, kwargs).run()
        # A direct call (``task(...)``) pushes no request: give it one of its own, so that
        # threads calling the task at once do not share Celery's default request (and lease).
        self.push_request(args=args, kwargs=kwargs, called_directly=True)
        try:
            return Gate(self, args, kwargs).run()
        finally:
            self.pop_request()

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

    @property
    def backend(self) -> Any:
        """Celery's result backend; for an owner whose settle deadline passed on its own clock
        (it stalled before Celery stored the outcome), behind ``SettlementCheck``. Otherwise
        the backend itself: the normal path costs nothing."""
        backend = result_backend(self)
        handle = getattr(self.request, "lease", None)
        if isinstance(handle, Execution) and handle.settling_past_deadline():
            return SettlementCheck(backend, handle)
        return backend

    @backend.setter
    def backend(self, value: Any) -> None:
        self._backend = value


def _settling_after_return(own: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a subclass's ``after_return`` so the settle phase ends first, always."""

    @functools.wraps(own)
    def after_return(self: LeasedTask, status: str, *args: Any, **kwargs: Any) -> Any:
        confirm_stored(getattr(self.request, "lease", None), status)
        return own(self, status, *args, **kwargs)

    after_return.lease_celery_settles = True  # type: ignore[attr-defined]
    return after_return
