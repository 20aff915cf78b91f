"""The Quint spec of the delivery protocol (spec/delivery.qnt) and the stores held to each
other: traces the simulator wrote (ITF, with the action each step took: ``quint run --mbt``)
are replayed against every store, and after every step each key's row must be the spec's.

The traces are spec/traces/*.itf.json, written by ``spec/traces.sh`` (Quint from npm); this
test needs no Node. A step's store call: a delivery claims (granted exactly when the spec
hands out a new token), or completes a settle phase past its deadline (``claim_settlement``,
when the spec makes it the row's owner); a renewal renews (it must be granted: the spec
renews only a current lease); a finish finishes with a settle phase (accepted exactly when
the spec accepts it); a confirmation settles (True exactly when the spec ends the phase);
callbacks, crashes, restarts, redeliveries, sweeps and ticks move only the broker, the
workers and the clock.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from lease_celery import Lease, LeaseState, Store, open_store
from lease_celery.testing import ManualClock

TRACES = sorted((Path(__file__).resolve().parents[2] / "spec" / "traces").glob("*.itf.json"))
BASE = 1_000.0
TTL = 3  # the spec's TTL and SETTLE
SETTLE = 2
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
    take a lapsed lease over and refuse the stale holder's finish, and some complete a settle
    phase whose owner died."""
    assert len(TRACES) >= 3
    seen: set[str] = set()
    for path in TRACES:
        states = _states(path)
        for before, after in itertools.pairwise(states):
            action, worker = after["actionTaken"], after["nondetPicks"].get("w")
            seen.add(action)
            if action == "finish":
                held = before["holding"][worker]
                seen.add("accepted" if after["accepted"][held] != before["accepted"][held]
                         else "refused")
            if action == "deliver":
                key = after["nondetPicks"]["k"]
                if (after["highest"][key] > before["highest"][key]
                        and before["rows"][key]["state"] == "Live"):
                    seen.add("takeover")
                if (after["rows"][key]["settling"]
                        and after["rows"][key]["owner"] != before["rows"][key]["owner"]
                        and after["highest"][key] == before["highest"][key]):
                    seen.add("completion")
    assert {"deliver", "renew", "finish", "confirm", "tick", "accepted", "refused",
            "takeover", "completion"} <= seen, seen


@pytest.mark.parametrize("trace", TRACES, ids=[path.stem for path in TRACES])
def test_a_store_follows_the_spec_step_by_step(store_url: str, trace: Path) -> None:
    clock = ManualClock(BASE)
    with open_store(store_url, clock=clock) as store:
        _replay(store, clock, _states(trace))


def _replay(store: Store, clock: ManualClock, states: list[dict[str, Any]]) -> None:
    first = states[0]
    for key, row in first["rows"].items():
        if row["state"] == "Ready":
            assert store.record_published(key, task={"options": {"task_id": key}})
    epoch = store.epoch()
    base = 0 if epoch is None else epoch.floor  # Redis starts a key's tokens above its floor
    leases: dict[str, Lease] = {}
    for before, after in itertools.pairwise(states):
        clock.set(BASE + after["now"])
        action, picks = after["actionTaken"], after["nondetPicks"]
        worker, key = picks.get("w"), picks.get("k")
        step = f"step {after['#meta']['index'] if '#meta' in after else '?'}: {action}"
        if action == "deliver":
            granted = store.claim(key, owner=worker, ttl=TTL)
            grew = after["highest"][key] > before["highest"][key]
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
        elif action == "finish":
            held = before["holding"][worker]
            accepted = after["accepted"][held] != before["accepted"][held]
            assert store.finish(leases[worker], {"ok": 1}, settle_within=SETTLE) is accepted, \
                step
        elif action == "confirm":
            held = before["holding"][worker]
            ended = before["rows"][held]["settling"] and not after["rows"][held]["settling"]
            assert store.settle(leases[worker]) is ended, step
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
