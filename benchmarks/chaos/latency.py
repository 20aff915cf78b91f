"""How long a fault keeps work waiting: from a kill or a stop to the settle of each key its
victim held (pure, from the event log, like the checker).

A key is *hit* by a ``kill`` when a process of the killed group held its lease at the fault
(its last ``lease_acquired`` or ``lease_taken_over`` was by that process, with no end since),
and by a ``stop`` when the stopped pool child held it. It *settles* at the first accepted finish
(``lease_finished``) or ``lease_dead`` of the key after the fault, by any process. A key whose
sweep was also killed between its mark and its re-publish (a ``sweep_kill`` naming it) waits a
sweep grace more by design: it is counted apart.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from .events import Event
from .history import History

__all__ = ["FaultLatency", "fault_latencies", "format_latency"]

#: Events after which the recording process holds the key's lease.
_HOLDS = ("lease_acquired", "lease_taken_over")
#: Events after which it no longer does.
_ENDS = ("lease_finished", "lease_dead", "lease_released", "lease_lost")
#: The ends that settle a key.
_SETTLES = ("lease_finished", "lease_dead")


@dataclass
class FaultLatency:
    """Seconds from fault to settle of each key a kind of fault hit; keys never settled."""

    seconds: list[float] = field(default_factory=list)
    unsettled: int = 0


def _victims(event: Event) -> set[int]:
    if event.get("kind") == "kill":
        return {int(pid) for pid in event.get("pids") or []}
    if event.get("kind") == "stop" and event.get("target") is not None:
        return {int(event["target"])}
    return set()


def fault_latencies(history: History) -> dict[str, FaultLatency]:
    """Per fault kind (``kill``, ``stop``, and ``kill+sweep``/``stop+sweep`` for keys whose
    sweep was killed too), the fault-to-settled seconds of every key it hit."""
    events = sorted(history.events, key=lambda e: float(e.get("t", 0.0)))
    swept_keys = {str(key) for e in events
                  if e.get("event") == "fault" and e.get("kind") == "sweep_kill"
                  for key in e.get("keys") or []}
    holder: dict[str, int] = {}
    waiting: dict[str, list[tuple[str, float]]] = defaultdict(list)  # key -> (kind, fault t)
    found: dict[str, FaultLatency] = defaultdict(FaultLatency)
    for event in events:
        name, key, t = event.get("event"), event.get("key"), float(event.get("t", 0.0))
        if name == "fault" and event.get("kind") in ("kill", "stop"):
            victims = _victims(event)
            for held, pid in holder.items():
                if pid in victims:
                    kind = str(event["kind"]) + ("+sweep" if held in swept_keys else "")
                    waiting[held].append((kind, t))
            continue
        if key is None:
            continue
        key = str(key)
        if name in _HOLDS:
            holder[key] = int(event.get("pid", 0))
        elif name in _ENDS:
            if holder.get(key) == int(event.get("pid", 0)):
                del holder[key]
            if name in _SETTLES:
                for kind, at in waiting.pop(key, []):
                    found[kind].seconds.append(t - at)
    for hits in waiting.values():
        for kind, _ in hits:
            found[kind].unsettled += 1
    return dict(sorted(found.items()))


def _percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile of ``values`` (not empty)."""
    ordered = sorted(values)
    return ordered[max(math.ceil(fraction * len(ordered)) - 1, 0)]


def format_latency(latency: FaultLatency) -> str:
    """``n keys: p50 … / p95 … / max …`` (and the unsettled count)."""
    values = latency.seconds
    shown = (f"{len(values)} keys: p50 {_percentile(values, 0.5):.1f}s / p95 "
             f"{_percentile(values, 0.95):.1f}s / max {max(values):.1f}s" if values
             else "no key")
    return shown + (f", {latency.unsettled} never settled" if latency.unsettled else "")
