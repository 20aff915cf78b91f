"""Lease keys: which deliveries count as "the same work".

``lease_key`` on a task is a format string over the task's arguments
(``"report:{report_id}"``), a callable taking the task's arguments and returning a str, or
``None`` for the task id (so only re-deliveries of one message count as duplicates).
"""

from __future__ import annotations

import functools
import inspect
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .checks import check_key
from .errors import ConfigError, InvalidKey

__all__ = ["DIRECT_KEY_PREFIX", "KeySpec", "check_key_spec", "message_key", "resolve_key"]

KeySpec = str | Callable[..., str] | None
#: The key of a direct call (``task(...)``, an errback Celery calls with ``(request, exc,
#: traceback)``) of a task with no ``lease_key``: it has no delivery id to key on, so it runs
#: under a lease of its own, ``direct:<uuid4>``, that no other call shares.
DIRECT_KEY_PREFIX = "direct:"


def _field_roots(template: str, name: str = "lease_key") -> list[str]:
    roots = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        root = field.split(".", 1)[0].split("[", 1)[0]
        if not root or root.isdigit():
            raise ConfigError(f"{name} {template!r}: use named fields such as {{report_id}},"
                              " not positional ones")
        roots.append(root)
    return roots


def check_key_spec(spec: object, run: Callable[..., Any] | None, *, where: str,
                   name: str = "lease_key") -> None:
    """Refuse a ``lease_key`` (or ``name``: ``lease_limit_key``) that can never resolve,
    naming the task it belongs to."""
    if spec is None or callable(spec):
        return
    if not isinstance(spec, str):
        raise ConfigError(f"{name} of {where} must be a format string, a callable or None,"
                          f" got {type(spec).__name__}")
    try:
        roots = _field_roots(spec, name)
    except ValueError as exc:
        raise ConfigError(f"{name} {spec!r} of {where} is not a valid format string: {exc}"
                          ) from exc
    if run is None:
        return
    params = inspect.signature(run).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    missing = [root for root in roots if root not in params]
    if missing:
        raise ConfigError(f"{name} {spec!r} of {where} names {missing}, which are not"
                          f" parameters of the task ({', '.join(params) or 'none'})")


@functools.lru_cache(maxsize=1024)
def _signature(run: Callable[..., Any]) -> tuple[inspect.Signature, str | None]:
    """The body's signature and its ``**kwargs`` parameter, if any (computed once per task:
    ``inspect.signature`` costs tens of microseconds, on every delivery otherwise)."""
    signature = inspect.signature(run)
    var_keyword = next((name for name, p in signature.parameters.items()
                        if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    return signature, var_keyword


def resolve_key(spec: KeySpec, run: Callable[..., Any], args: Sequence[Any],
                kwargs: Mapping[str, Any], *, task_id: str | None,
                name: str = "lease_key") -> str:
    """Compute the lease key (or ``name``: the limit group) of one delivery; raise
    ``InvalidKey`` naming the problem."""
    if spec is None:
        if not task_id:
            raise InvalidKey("no lease_key is set and the task has no id to use as the key")
        return check_key(task_id)
    if callable(spec):
        return check_key(spec(*args, **kwargs))
    signature, var_keyword = _signature(run)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise InvalidKey(f"{name} {spec!r}: the task arguments do not fit: {exc}") from exc
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    if var_keyword is not None:
        arguments.update(arguments.pop(var_keyword, {}))
    try:
        return check_key(spec.format(**arguments))
    except (KeyError, IndexError, AttributeError) as exc:
        raise InvalidKey(f"{name} {spec!r} cannot be formatted from the task arguments"
                         f" {sorted(arguments)}: {exc!r}") from exc


def message_key(task: Any, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None,
                task_id: str | None) -> str:
    """The lease key of a message of ``task`` with these arguments, as a publisher (or a
    receiver of Celery's signals) has them: ``args``/``kwargs`` may be None."""
    return resolve_key(task.lease_key, task.run, tuple(args or ()), dict(kwargs or {}),
                       task_id=task_id)
