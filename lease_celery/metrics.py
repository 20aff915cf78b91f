"""Counters and histograms for every lease_celery signal, in process and for Prometheus.

``snapshot()`` returns this process's figures. With ``pip install 'lease-celery[prometheus]'``
the same figures are Prometheus metrics (``lease_celery_*``); set ``PROMETHEUS_MULTIPROC_DIR``
before the worker starts so prefork children share them, and expose them with
:func:`serve` or the ``lease_metrics_port`` setting (the worker's main process serves them).
Recording never breaks a task: it runs in signal receivers, whose errors Celery logs.
"""

from __future__ import annotations

import bisect
import itertools
import os
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from . import signals
from .extras import needs

__all__ = ["COUNTERS", "GAUGES", "HISTOGRAMS", "reset", "serve", "snapshot"]

#: signal name -> counter name. Every signal has one.
COUNTERS: dict[str, str] = {
    "lease_acquired": "claims",
    "lease_taken_over": "takeovers",
    "lease_renewed": "renewals",
    "lease_lost": "renew_failures",
    "lease_finished": "finished",
    "lease_settled": "settled",
    "settle_completed": "settles_completed",
    "lease_released": "releases",
    "lease_retry": "retries",
    "lease_dead": "dead_letters",
    "lease_swept": "swept",
    "duplicate_deferred": "duplicates_deferred",
    "duplicate_ignored": "duplicates_ignored",
    "duplicate_answered": "duplicates_answered",
    "stale_result_rejected": "stale_results_refused",
    "effect_performed": "effects_performed",
    "effect_replayed": "effect_replays",
    "effect_conflict": "effect_conflicts",
    "effect_outcome_unknown": "effects_outcome_unknown",
    "limit_wait": "limit_waits",
    "limit_handed_on": "limit_handed_on",
}

#: Gauges of key-group limits, per task name (groups are never labels: there may be one per
#: tenant). ``limit_running``: this process's limited leases held now; ``limit_waiting``:
#: deliveries parked minus those handed on (summed over processes, dead ones included).
GAUGES = ("limit_running", "limit_waiting")
#: Signals that end a hold: a limited lease among them leaves ``limit_running``.
_HOLD_ENDS = frozenset({"lease_finished", "lease_released", "lease_dead", "lease_lost",
                        "stale_result_rejected"})

#: histogram name -> (signal names, keyword carrying the value in seconds).
HISTOGRAMS: dict[str, tuple[tuple[str, ...], str]] = {
    "heartbeat_delay_seconds": (("lease_renewed",), "delay"),
    "lease_hold_seconds": (("lease_finished", "lease_released", "lease_dead", "lease_lost",
                            "stale_result_rejected"), "hold_time"),
    "task_duration_seconds": (("lease_finished",), "duration"),
}

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
            float("inf"))


@dataclass
class _Histogram:
    count: int = 0
    total: float = 0.0
    #: Observations per bucket, each counted once (in the first bucket whose bound holds it);
    #: ``buckets`` adds them up as Prometheus does.
    per_bucket: list[int] = field(default_factory=lambda: [0] * len(_BUCKETS))

    def observe(self, value: float) -> None:
        self.count += 1
        self.total += value
        index = bisect.bisect_left(_BUCKETS, value)
        if index < len(_BUCKETS):  # NaN lands nowhere, as with the comparisons before
            self.per_bucket[index] += 1

    @property
    def buckets(self) -> list[int]:
        """Cumulative: how many observations were at most each bound."""
        return list(itertools.accumulate(self.per_bucket))


_lock = threading.Lock()
_counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
_histograms: dict[str, _Histogram] = defaultdict(_Histogram)
_gauges: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
#: task name -> (key, token) of the limited leases this process holds.
_limited: dict[str, set[tuple[str, int]]] = defaultdict(set)
_prometheus: dict[str, Any] | None = None
_creation_lock = threading.Lock()


def _label(sender: Any) -> str:
    return str(getattr(sender, "name", None) or "") if sender is not None else ""


def _prometheus_metrics() -> dict[str, Any]:
    """The Prometheus metric objects, made on first use (empty without prometheus_client)."""
    global _prometheus
    if _prometheus is not None:
        return _prometheus
    with _creation_lock:  # two first events at once must not both register the metrics
        if _prometheus is not None:
            return _prometheus
        try:
            from prometheus_client import Counter, Gauge, Histogram
        except ImportError:
            _prometheus = {}
        else:
            made: dict[str, Any] = {}
            for name in COUNTERS.values():
                made[name] = Counter(f"lease_celery_{name}", f"lease_celery: {name}", ["task"])
            for name in HISTOGRAMS:
                made[name] = Histogram(f"lease_celery_{name}", f"lease_celery: {name}",
                                       buckets=_BUCKETS)
            made["limit_running"] = Gauge("lease_celery_limit_running",
                                          "lease_celery: limited leases held", ["task"],
                                          multiprocess_mode="livesum")
            made["limit_waiting"] = Gauge("lease_celery_limit_waiting",
                                          "lease_celery: deliveries parked over a limit",
                                          ["task"], multiprocess_mode="sum")
            _prometheus = made
    return _prometheus


#: signal name -> the histograms it feeds, as (histogram, keyword) pairs (computed once: this
#: runs several times per task).
_OBSERVES: dict[str, list[tuple[str, str]]] = {
    signal_name: [(name, kw) for name, (sources, kw) in HISTOGRAMS.items()
                  if signal_name in sources]
    for signal_name in COUNTERS}
#: (counter, task) -> its Prometheus child (``labels()`` costs a lookup and a lock per call).
_children: dict[tuple[str, str], Any] = {}


def _gauge_moves(signal_name: str, task: str, fields: dict[str, Any]) -> dict[str, int]:
    """How this event moves the limit gauges of ``task`` (under ``_lock``)."""
    if signal_name == "limit_wait":
        return {"limit_waiting": 1}
    if signal_name == "limit_handed_on":
        return {"limit_waiting": -1}
    lease: Any = fields.get("lease")
    if getattr(lease, "group", None) is None:
        return {}
    held = _limited[task]
    before = len(held)
    if signal_name == "lease_acquired":
        held.add((lease.key, lease.token))
    elif signal_name in _HOLD_ENDS:
        held.discard((lease.key, lease.token))
    return {"limit_running": len(held) - before} if len(held) != before else {}


#: The signals that may move a limit gauge (the others skip the gauge bookkeeping).
_GAUGED = frozenset({"limit_wait", "limit_handed_on", "lease_acquired", *_HOLD_ENDS})
_NO_MOVES: dict[str, int] = {}


def _record(signal_name: str, sender: Any, fields: dict[str, Any]) -> None:
    counter = COUNTERS[signal_name]
    waiter = fields.get("waiter")
    # A hand-on is sent by the app, for a waiter of some task: counted under that task.
    task = (str((waiter.task or {}).get("task") or "") if waiter is not None
            else _label(sender))
    observes = _OBSERVES[signal_name]
    observed = [(name, float(value)) for name, kw in observes
                if (value := fields.get(kw)) is not None] if observes else []
    with _lock:
        _counts[counter][task] += 1
        for name, value in observed:
            _histograms[name].observe(value)
        moves = (_gauge_moves(signal_name, task, fields) if signal_name in _GAUGED
                 else _NO_MOVES)
        for name, by in moves.items():
            _gauges[name][task] += by
    prometheus = _prometheus if _prometheus is not None else _prometheus_metrics()
    if prometheus:
        for name, by in moves.items():
            prometheus[name].labels(task=task).inc(by)
        child = _children.get((counter, task))
        if child is None:
            child = _children[counter, task] = prometheus[counter].labels(task=task)
        child.inc()
        for name, value in observed:
            prometheus[name].observe(value)


def _receiver(signal_name: str) -> Any:
    def receive(sender: Any = None, **fields: Any) -> None:
        _record(signal_name, sender, fields)

    return receive


def install() -> None:
    """Count lease_celery's signals in this process (wiring)."""
    for signal_name in COUNTERS:
        getattr(signals, signal_name).connect(_receiver(signal_name), weak=False,
                                              dispatch_uid=f"lease_celery.metrics.{signal_name}")


def snapshot() -> dict[str, Any]:
    """This process's figures: ``{"counters": {name: {task: n}}, "histograms": {...}}``."""
    with _lock:
        return {
            "counters": {name: dict(_counts[name]) for name in COUNTERS.values()},
            "totals": {name: sum(_counts[name].values()) for name in COUNTERS.values()},
            "gauges": {name: dict(_gauges[name]) for name in GAUGES},
            "histograms": {name: {"count": h.count, "sum": h.total,
                                  "buckets": dict(zip(map(str, _BUCKETS), h.buckets,
                                                      strict=True))}
                           for name, h in ((n, _histograms[n]) for n in HISTOGRAMS)},
        }


def reset() -> None:
    """Forget this process's figures (tests)."""
    with _lock:
        _counts.clear()
        _histograms.clear()
        _gauges.clear()
        _limited.clear()


def serve(port: int, addr: str = "127.0.0.1") -> None:
    """Serve the Prometheus metrics over HTTP (all prefork children's, in multiprocess mode).

    Needs prometheus_client: an ImportError naming ``pip install 'lease-celery[prometheus]'``
    without it (the in-process figures, :func:`snapshot`, need nothing)."""
    with needs("lease_celery.metrics.serve", "prometheus_client", extra="prometheus"):
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.multiprocess import MultiProcessCollector
    _prometheus_metrics()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        start_http_server(port, addr=addr, registry=registry)
    else:
        start_http_server(port, addr=addr)
