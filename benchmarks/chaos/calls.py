"""Every store call a worker process makes, recorded for the model's judgement
(:mod:`benchmarks.chaos.linearizable`): an ``invoke`` event before the call and a ``complete``
event after it, per key (a batch call is one call per lease, sharing the interval).

The store's public methods are wrapped on ``Store`` itself (monkeypatched from here, the
library is not edited), once per process before the pool forks. The invoke's time is taken
before the call is sent and the complete's after its answer came back, so the instant the
store decided lies between them.
"""

from __future__ import annotations

import functools
import threading
import uuid
from collections.abc import Callable
from typing import Any

from lease_celery.models import Lease
from lease_celery.stores.base import Store

from .events import EventLog

__all__ = ["commit_known", "record_store_calls"]

Split = Callable[[tuple[Any, ...], dict[str, Any]], list[dict[str, Any]]]
Answers = Callable[[Any], list[Any]]


def _lease(lease: Lease, op: str, **fields: Any) -> dict[str, Any]:
    return {"op": op, "key": lease.key, "owner": lease.owner, "token": lease.token, **fields}


def _granted(lease: Lease | None) -> Any:
    return None if lease is None else [lease.token, lease.expires_at]


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], at: int, name: str,
         default: Any = None) -> Any:
    return args[at] if len(args) > at else kwargs.get(name, default)


#: method -> (the calls it makes, per key; their answers, in the same order)
WRAPPED: dict[str, tuple[Split, Answers]] = {
    "claim": (lambda a, k: [{"op": "claim", "key": a[0], "owner": k["owner"],
                             "ttl": k["ttl"]}],
              lambda answer: [_granted(answer)]),
    "claim_settlement": (lambda a, k: [{"op": "claim_settlement", "key": a[0],
                                        "owner": k["owner"], "ttl": k["ttl"]}],
                         lambda answer: [_granted(answer)]),
    "renew_many": (lambda a, k: [_lease(lease, "renew", ttl=k["ttl"]) for lease in a[0]],
                   lambda answer: [_granted(lease) for lease in answer]),
    "finish": (lambda a, k: [_lease(a[0], "finish", settle_within=k.get("settle_within"))],
               lambda answer: [answer]),
    "kill": (lambda a, k: [_lease(a[0], "kill", settle_within=k.get("settle_within"))],
             lambda answer: [answer]),
    "release": (lambda a, k: [_lease(a[0], "release", delay=k.get("delay", 0.0))],
                lambda answer: [answer]),
    "settle_many": (lambda a, k: [_lease(lease, "settle") for lease in a[0]],
                    lambda answer: list(answer)),
    "finish_and_claim": (
        lambda a, k: [_lease(a[0], "finish"),
                      {"op": "claim", "key": _arg(a, k, 2, "key"), "owner": k["owner"],
                       "ttl": k["ttl"]}],
        lambda answer: [answer[0], _granted(answer[1])]),
}


def record_store_calls(events: EventLog) -> None:
    """Wrap the store's public calls so that each is recorded (idempotent)."""
    for name, (split, answers) in WRAPPED.items():
        original = getattr(Store, name)
        if getattr(original, "_chaos_recorded", False):
            continue
        setattr(Store, name, _recorded(original, split, answers, events))
    if not getattr(Store.finish_in, "_chaos_recorded", False):
        Store.finish_in = _recorded_finish_in(Store.finish_in, events)  # type: ignore[method-assign]


#: The finish written in the app's transaction whose commit is not known yet, per thread.
_uncommitted = threading.local()


def _recorded_finish_in(original: Callable[..., Any], events: EventLog) -> Callable[..., Any]:
    """``finish_in`` as the model's ``finish``: it takes effect when the app's transaction
    commits, so an accepted one completes only once the body knows the commit
    (:func:`commit_known`); a refused one rolls back, so its answer is known at once."""

    @functools.wraps(original)
    def finish_in(self: Store, conn: Any, lease: Lease, *args: Any, **kwargs: Any) -> Any:
        call_id = uuid.uuid4().hex
        events.record("store_call", phase="invoke", call=call_id,
                      **_lease(lease, "finish", settle_within=kwargs.get("settle_within")))
        try:
            accepted = original(self, conn, lease, *args, **kwargs)
        except Exception as exc:
            events.record("store_call", phase="complete", call=call_id,
                          error=type(exc).__name__)
            raise
        if accepted:
            _uncommitted.call = (events, call_id)
        else:
            events.record("store_call", phase="complete", call=call_id, answer=False)
        return accepted

    finish_in._chaos_recorded = True  # type: ignore[attr-defined]
    return finish_in


def commit_known(committed: bool | None) -> None:
    """Complete this thread's pending ``finish_in`` call: True, the transaction committed;
    None, its commit failed with an unknown outcome. Nothing pending: nothing to say."""
    pending = getattr(_uncommitted, "call", None)
    _uncommitted.call = None
    if pending is None:
        return
    events, call_id = pending
    if committed:
        events.record("store_call", phase="complete", call=call_id, answer=True)
    else:
        events.record("store_call", phase="complete", call=call_id, error="CommitUnknown")


def _recorded(original: Callable[..., Any], split: Split, answers: Answers,
              events: EventLog) -> Callable[..., Any]:
    @functools.wraps(original)
    def recorded(self: Store, *args: Any, **kwargs: Any) -> Any:
        calls = split(args, kwargs)
        ids = [uuid.uuid4().hex for _ in calls]
        for call_id, call in zip(ids, calls, strict=True):
            events.record("store_call", phase="invoke", call=call_id, **call)
        try:
            answer = original(self, *args, **kwargs)
        except Exception as exc:
            for call_id in ids:  # the outcome is unknown: it may have taken effect
                events.record("store_call", phase="complete", call=call_id,
                              error=type(exc).__name__)
            raise
        for call_id, told in zip(ids, answers(answer), strict=True):
            events.record("store_call", phase="complete", call=call_id, answer=told)
        return answer

    recorded._chaos_recorded = True  # type: ignore[attr-defined]
    return recorded
