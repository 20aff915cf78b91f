"""The Quint spec of the delivery protocol (spec/delivery.qnt) and the stores held to each
other: traces the simulator wrote (ITF, with the action each step took: ``quint run --mbt``)
are replayed against every store, and after every step each key's row, and the limit group's
running and waiting counts, must be the spec's.

The traces are spec/traces/*.itf.json, written by ``spec/traces.sh`` (Quint from npm); this
test needs no Node. A step's store call: a delivery claims (granted exactly when the spec
hands out a new token), carrying the finish the worker queued behind its last return if it has
one (``finish_and_claim``: accepted exactly when the spec accepts it), or claims a key of the
limit group (``claim_limited``: granted, parked as a waiter, or refused, as the spec), or
completes a settle phase past its deadline (``claim_settlement``, when the spec makes it the
row's owner); a renewal renews (it must be granted: the spec renews only a current lease), as
does a renewal of a lease whose finish is queued; a finish finishes with a settle phase (the
job and its callback) or settled at once (a group key), accepted exactly when the spec accepts
it, or is queued (the fire-and-forget key: no store call); a queued finish that no claim
carried is written alone; a hand-on (the worker's or the sweeper's) returns exactly the
waiters the spec hands on; a confirmation settles (True exactly when the spec ends the phase);
callbacks, publishes, crashes, restarts, redeliveries, sweeps and ticks move only the broker,
the workers and the clock.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from lease_celery import Lease, LeaseState, Store, open_store
from lease_celery.limits import GroupLimit, LimitRefused
from lease_celery.testing import ManualClock

TRACES = sorted((Path(__file__).resolve().parents[2] / "spec" / "traces").glob("*.itf.json"))
BASE = 1_000.0
TTL = 3  # the spec's TTL, SETTLE, GRACE and its group's limit
SETTLE = 2
GRACE = 2
GROUP = GroupLimit("g", limit=1)
GROUP_KEYS = ("g1", "g2")
STATES = {"Ready": LeaseState.READY, "Live": LeaseState.RUNNING, "Done": LeaseState.DONE}


def _value(raw: Any) -> Any:
    """An ITF value as Python: bigints as int, maps as dict, sets as frozenset, variants as
    their tag."""
    if isinstance(raw, dict):
        if "#bigint" in raw:
            return int(raw["#bigint"])
        if "#map" in raw:
            return {_value(k): _value(v) for k, v in raw["#map"]}
        if "#set" in raw:
            return frozenset(_value(v) for v in raw["#set"])
        if "tag" in raw:
            return raw["tag"] if raw["tag"] != "Some" else _value(raw["value"])
        return {k: _value(v) for k, v in raw.items() if not k.startswith("#")}
    return raw


def _states(path: Path) -> list[dict[str, Any]]:
    """Each state of the trace by its variables' short names (``rows``, ``actionTaken``...)."""
    return [{name.rsplit("::", 1)[-1]: _value(value) for name, value in state.items()
             if not name.startswith("#")}
            for state in json.loads(path.read_text())["states"]]


def test_the_traces_are_there() -> None:
    """The replay below is not vacuous: traces exist, they renew, they accept outcomes, some
    take a lapsed lease over and refuse the stale holder's finish, some complete a settle
    phase whose owner died, some carry a queued finish in the next claim (accepted, and
    refused as stale), renew a queued finish or write it alone, and some park a delivery of
    the full group, hand it on (a worker, the sweeper) and claim it."""
    assert len(TRACES) >= 3
    seen: set[str] = set()
    for path in TRACES:
        states = _states(path)
        for before, after in itertools.pairwise(states):
            action, worker = after["actionTaken"], after["nondetPicks"].get("w")
            key = after["nondetPicks"].get("k")
            seen.add(action)
            if action == "finish":
                held = before["holding"][worker]
                if held in after["accepted"] and held != "bg":
                    seen.add("accepted" if after["accepted"][held] != before["accepted"][held]
                             else "refused")
            if action == "deliver":
                if (after["highest"][key] > before["highest"][key]
                        and before["rows"][key]["state"] == "Live"):
                    seen.add("takeover")
                if (after["rows"][key]["settling"]
                        and after["rows"][key]["owner"] != before["rows"][key]["owner"]
                        and after["highest"][key] == before["highest"][key]):
                    seen.add("completion")
                carried = before["carry"][worker]["key"]
                if carried and key not in GROUP_KEYS:
                    seen.add("carried accepted" if after["accepted"][carried]
                             != before["accepted"][carried] else "carried refused")
                if key in GROUP_KEYS and after["waiting"][key] and not before["waiting"][key]:
                    seen.add("parked")
                if (key in GROUP_KEYS and before["handedAt"][key] >= 0
                        and after["highest"][key] > before["highest"][key]):
                    seen.add("handed on, claimed")
            if action in ("handOn", "sweepHandOn") and _handed(before, after):
                seen.add(f"{action} picked")
    assert {"deliver", "renew", "finish", "confirm", "tick", "accepted", "refused",
            "takeover", "completion", "carried accepted", "carried refused", "renewBehind",
            "writeBehind", "parked", "handOn picked", "sweepHandOn picked",
            "handed on, claimed"} <= seen, seen


def _handed(before: dict[str, Any], after: dict[str, Any]) -> set[str]:
    """The waiters a hand-on step handed on (marked now)."""
    return {key for key in GROUP_KEYS if after["handedAt"][key] != before["handedAt"][key]}


@pytest.mark.parametrize("trace", TRACES, ids=[path.stem for path in TRACES])
def test_a_store_follows_the_spec_step_by_step(store_url: str, trace: Path) -> None:
    clock = ManualClock(BASE)
    with open_store(store_url, clock=clock) as store:
        _replay(store, clock, _states(trace))


def _replay(store: Store, clock: ManualClock, states: list[dict[str, Any]]) -> None:
    first = states[0]
    for key, row in first["rows"].items():
        if row["state"] == "Ready":
            assert store.record_published(key, task=_task(key))
    epoch = store.epoch()
    base = 0 if epoch is None else epoch.floor  # Redis starts a key's tokens above its floor
    leases: dict[str, Lease] = {}
    queued: dict[str, Lease] = {}  # each worker's finish queued behind a return
    for index, (before, after) in enumerate(itertools.pairwise(states), start=1):
        clock.set(BASE + after["now"])
        action, picks = after["actionTaken"], after["nondetPicks"]
        worker, key = picks.get("w"), picks.get("k")
        step = f"step {index}: {action}"
        if action == "deliver" and key in GROUP_KEYS:
            limited = store.claim_limited(key, owner=worker, ttl=TTL, limit=GROUP,
                                          task=_task(key))
            grew = after["highest"][key] > before["highest"][key]
            parked = after["waiting"][key] > 0
            assert isinstance(limited, Lease) == grew, f"{step}({worker}, {key}): {limited}"
            assert (isinstance(limited, LimitRefused) and limited.parked) == parked, \
                f"{step}({worker}, {key}): {limited}"
            assert grew or parked or limited is None, f"{step}({worker}, {key}): {limited}"
            if isinstance(limited, Lease):
                leases[worker] = limited
        elif action == "deliver":
            grew = after["highest"][key] > before["highest"][key]
            carried = before["carry"][worker]["key"]
            if carried:
                accepted, granted = store.finish_and_claim(
                    queued.pop(worker), {"ok": 1}, key, owner=worker, ttl=TTL, task=_task(key))
                assert accepted is (after["accepted"][carried] != before["accepted"][carried]), \
                    f"{step}({worker}, {key}): the carried finish of {carried}: {accepted}"
            else:
                granted = store.claim(key, owner=worker, ttl=TTL, task=_task(key))
            assert (granted is not None) == grew, f"{step}({worker}, {key}): {granted}"
            completes = (not grew and after["rows"][key]["settling"]
                         and after["rows"][key]["owner"] != before["rows"][key]["owner"])
            if completes:
                granted = store.claim_settlement(key, owner=worker, ttl=SETTLE)
                assert granted is not None, f"{step}: the settle phase was not taken over"
            if granted is not None:
                leases[worker] = granted
        elif action == "renew":
            assert store.renew(leases[worker], ttl=TTL) is not None, step
        elif action == "renewBehind":
            renewed = store.renew(queued[worker], ttl=TTL)
            assert renewed is not None, step
            queued[worker] = renewed
        elif action == "finish":
            held = before["holding"][worker]
            accepted = after["accepted"][held] != before["accepted"][held]
            if after["carry"][worker]["key"] and not before["carry"][worker]["key"]:
                queued[worker] = leases[worker]  # behind the return: no store call yet
            elif held in GROUP_KEYS:
                assert store.finish(leases[worker], {"ok": 1}) is accepted, step
            else:
                assert store.finish(leases[worker], {"ok": 1}, settle_within=SETTLE) \
                    is accepted, step
        elif action == "writeBehind":
            written = before["carry"][worker]["key"]
            accepted = after["accepted"][written] != before["accepted"][written]
            assert store.finish(queued.pop(worker), {"ok": 1}) is accepted, step
        elif action in ("handOn", "sweepHandOn"):
            handed = {waiter.key for waiter in store.hand_on(GROUP.group, grace=GRACE)}
            assert handed == _handed(before, after), (step, handed)
        elif action == "confirm":
            held = before["holding"][worker]
            ended = before["rows"][held]["settling"] and not after["rows"][held]["settling"]
            assert store.settle(leases[worker]) is ended, step
        elif action == "crash":
            queued.pop(worker, None)  # dies with the process
        _compare(store, base, step, after)


def _compare(store: Store, base: int, step: str, after: dict[str, Any]) -> None:
    """Every key's row, and the group's running and waiting counts, are the spec's."""
    for name, row in after["rows"].items():
        record = store.get(name)
        if row["state"] == "None":
            assert record is None, (step, name, record)
            continue
        assert record is not None, (step, name, row)
        assert (record.state, record.token - base if record.token else 0) == (
            STATES[row["state"]], row["token"]), (step, name, record, row)
        if row["state"] != "Ready":
            assert record.owner == row["owner"], (step, name, record, row)
        assert record.settling == row["settling"], (step, name, record, row)
        if row["state"] == "Live" or row["settling"]:
            assert record.expires_at == BASE + row["expires"], (step, name, record, row)
    group = store.limit_group(GROUP.group)
    running = sum(1 for key in GROUP_KEYS if after["rows"][key]["state"] == "Live"
                  and after["rows"][key]["expires"] > after["now"])
    waiting = sum(1 for key in GROUP_KEYS if after["waiting"][key] > 0)
    counts = (group.running, group.waiting) if group is not None else (0, 0)
    assert counts == (running, waiting), (step, group, running, waiting)


def _task(key: str) -> dict[str, Any]:
    """What the gate records of a delivery: enough to publish it again."""
    return {"options": {"task_id": key}}
