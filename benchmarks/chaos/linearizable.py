"""The store's answers in a chaos run, judged by the reference model
(``lease_celery.stores.model``): per key, is there an order of the calls, each taking effect
at one instant between its invoke and its complete, in which the model gives every answer the
store gave? (Wing and Gong's search, as Porcupine does it, with Lowe's memo of states seen.)

The worker processes record each store call twice (:mod:`benchmarks.chaos.hooks`):
``store_call`` with ``phase`` ``invoke`` and ``complete``, the same ``call`` id, the
operation, the lease (key, owner, token), the ttl, and the answer: a claim's or renewal's
token and ``expires_at``, a write's True/False, or ``error`` (the outcome is unknown: it may
have taken effect or not). A call without its complete (the process was killed) is unknown
too. Every process runs on this machine, the servers too, so the store's clock at a call's
instant lies between the invoke's and the complete's ``t`` (give or take ``SKEW``); a granted
claim or renewal shows it exactly (``expires_at - ttl``).

Tokens are compared relative to the key's first: the Redis store starts a key above its
epoch's floor. A key whose calls met ``StoreDataLost`` is judged up to the loss only.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from lease_celery.models import Lease
from lease_celery.stores.model import Model

__all__ = ["Call", "calls_by_key", "explain", "smallest_unexplained"]

#: Seconds the store's clock may differ from the recording processes' (one machine).
SKEW = 0.005
#: Operations the model judges (the others leave a key's lease rows as they were, or are not
#: a worker's: effects live under their own keys, operator actions are not in a run).
JUDGED = ("claim", "renew", "finish", "release", "kill", "settle", "claim_settlement")


@dataclasses.dataclass(frozen=True)
class Call:
    """One store call on one key, as the run recorded it."""

    op: str
    key: str
    invoked: float
    completed: float  # math.inf: never answered (the process died)
    owner: str | None = None
    token: int | None = None
    ttl: float | None = None
    answer: Any = None  # None with known=False: the outcome is unknown
    known: bool = True
    settle_within: float | None = None
    delay: float = 0.0

    def describe(self) -> str:
        lease = "" if self.token is None else f" token {self.token}"
        told = repr(self.answer) if self.known else "unknown"
        return (f"{self.op}({self.owner}{lease}) [{self.invoked:.3f}, {self.completed:.3f}] "
                f"-> {told}")


def calls_by_key(events: Iterable[dict[str, Any]]) -> dict[str, list[Call]]:
    """The recorded store calls, by key, in the order they were invoked."""
    invokes: dict[str, dict[str, Any]] = {}
    completes: dict[str, dict[str, Any]] = {}
    for event in events:
        if event.get("event") != "store_call":
            continue
        (invokes if event.get("phase") == "invoke" else completes)[str(event["call"])] = event
    # After the store lost its data, rows vanish outside any call: judged up to the loss.
    loss = min((float(e["t"]) for e in completes.values()
                if e.get("error") == "StoreDataLost"), default=math.inf)
    found: dict[str, list[Call]] = defaultdict(list)
    for call_id, invoke in invokes.items():
        if invoke.get("op") not in JUDGED or float(invoke["t"]) >= loss:
            continue
        done = completes.get(call_id)
        if done is not None and float(done["t"]) >= loss:
            done = None
        known = done is not None and "error" not in done
        found[str(invoke["key"])].append(Call(
            op=str(invoke["op"]), key=str(invoke["key"]), invoked=float(invoke["t"]),
            completed=math.inf if done is None else float(done["t"]),
            owner=invoke.get("owner"), token=invoke.get("token"), ttl=invoke.get("ttl"),
            answer=None if not known or done is None else done.get("answer"), known=known,
            settle_within=invoke.get("settle_within"), delay=invoke.get("delay") or 0.0))
    return {key: sorted(calls, key=lambda c: c.invoked) for key, calls in found.items()}


def _apply(model: Model, call: Call) -> Any:
    """Make ``call`` on ``model``; its answer in the form the run records (token, deadline)."""
    if call.op in ("claim", "claim_settlement"):
        assert call.owner is not None and call.ttl is not None
        lease = getattr(model, call.op)(call.key, owner=call.owner, ttl=call.ttl)
        return None if lease is None else [lease.token, lease.expires_at]
    assert call.owner is not None and call.token is not None
    lease = Lease(call.key, call.owner, call.token, 0.0)
    if call.op == "renew":
        renewed = model.renew(lease, ttl=call.ttl or 0.0)
        return None if renewed is None else [renewed.token, renewed.expires_at]
    if call.op == "finish":
        return model.finish(lease, None, settle_within=call.settle_within)
    if call.op == "kill":
        return model.kill(lease, reason="-", settle_within=call.settle_within)
    if call.op == "release":
        return model.release(lease, delay=call.delay)
    return model.settle(lease)


def _matches(answer: Any, told: Any) -> bool:
    if isinstance(answer, list) and isinstance(told, list) and len(told) == 2:
        return bool(answer[0] == told[0]) and abs(answer[1] - float(told[1])) <= 1e-6
    return bool(answer == told)


def _instants(call: Call, last: float, model: Model, pinned: list[float]) -> list[float]:
    """When the call may have taken effect, never before the previous call's instant: a
    granted claim or renewal says exactly. Else the instants where anything can change
    inside its interval: its ends, just before and at each deadline the key's row has (a
    lease expires, a backoff ends), and the instants other calls' answers pin. (An ending
    with a settle phase or a backoff writes a deadline counted from its instant: taken just
    before the lease expires, it leaves the longest phase; either end may be the one.)"""
    if call.known and isinstance(call.answer, list) and call.ttl is not None:
        return [float(call.answer[1]) - call.ttl]
    start = max(call.invoked - SKEW, last)
    end = call.completed + SKEW if math.isfinite(call.completed) else start + 3600.0
    if end <= start:
        return [start]
    deadlines = [t for row in model.rows.values() for t in (row.expires_at, row.not_before)
                 if t is not None]
    inside = {t for t in [*pinned, *deadlines, *(t - 1e-6 for t in deadlines)]
              if start < t < end}
    return [start, *sorted(inside), end]


def explain(calls: list[Call], end: tuple[str, int] | None = None) -> bool:
    """Is there an order of ``calls`` (each at an instant inside its interval, instants not
    going back) in which the model answers as the store did, and ends the key as the store
    did (``end``: the row's state and token; None: not judged)? Calls of unknown outcome may
    take effect anywhere after their invoke, or never."""
    if not calls:
        return True
    tokens = [int(c.answer[0]) for c in calls
              if c.known and c.op == "claim" and isinstance(c.answer, list)]
    tokens += [int(c.token) for c in calls if c.token is not None]
    lowest_told = min(tokens) if tokens else 1
    # Tokens are judged relative to the key's first (see the module's docstring). The lowest
    # token told is that first one, unless claims whose answer never came back took tokens
    # below it: each such claim may have taken one.
    untold = sum(1 for c in calls if c.op == "claim" and not c.known)
    return any(_explain_from(calls, end, lowest_told - below) for below in range(untold + 1))


def _explain_from(calls: list[Call], end: tuple[str, int] | None, first_token: int) -> bool:
    """``explain``, the key's first token being ``first_token``."""
    calls = [dataclasses.replace(
        c, token=None if c.token is None else c.token - first_token + 1,
        answer=[int(c.answer[0]) - first_token + 1, c.answer[1]]
        if isinstance(c.answer, list) else c.answer) for c in calls]
    final = None if end is None else (end[0], end[1] - first_token + 1)
    pinned = [float(c.answer[1]) - c.ttl for c in calls
              if c.known and isinstance(c.answer, list) and c.ttl is not None]
    clock = [0.0]
    seen: set[tuple[frozenset[int], str, float]] = set()

    def ends_as_the_store(model: Model) -> bool:
        if final is None:
            return True
        row = model.rows.get(calls[0].key)
        if row is None:
            return final[0] == "missing"
        return (row.state.value, row.token) == final

    def search(model: Model, done: frozenset[int], last: float) -> bool:
        pending = [i for i in range(len(calls)) if i not in done]
        if all(not calls[i].known for i in pending) and ends_as_the_store(model):
            return True  # the rest may never have taken effect
        if not pending:
            return False
        memo = (done, repr(sorted(model.rows.items())), last)  # Lowe: a state seen fails again
        if memo in seen:
            return False
        seen.add(memo)
        horizon = min(calls[i].completed for i in pending)
        for i in pending:
            call = calls[i]
            if call.invoked > horizon + SKEW:
                break  # a pending call completed before this one began: it goes first
            if not call.known and search(model, done | {i}, last):
                return True  # its outcome is unknown: it may not have taken effect at all
            for instant in _instants(call, last, model, pinned):
                if instant < last - SKEW or instant > call.completed + SKEW:
                    continue
                trial = copy.deepcopy(model)
                clock[0] = instant
                answer = _apply(trial, call)
                if call.known and not _matches(answer, call.answer):
                    continue
                if search(trial, done | {i}, max(last, instant)):
                    return True
        return False

    model = Model(lambda: clock[0])
    return search(model, frozenset(), -math.inf)


def smallest_unexplained(calls: list[Call], end: tuple[str, int] | None = None
                         ) -> list[Call] | None:
    """None if ``calls`` (and the key's ``end``) are explained; else the shortest prefix of
    ``calls`` (in invoke order) that no order explains (all of them when only the end is
    not)."""
    if explain(calls, end):
        return None
    for upto in range(1, len(calls)):
        if not explain(calls[:upto]):
            return calls[:upto]
    return calls
