"""OpenTelemetry: lease events on each run's span, and span links across re-publishes.

``pip install 'lease-celery[otel]'``, then call :func:`instrument` once per process, beside
``CeleryInstrumentor().instrument()`` (opentelemetry-instrumentation-celery opens the run spans
this module adds events to). From then on every lease signal becomes an event
(:data:`EVENTS`) with the attributes ``lease.key``, ``lease.token``, ``lease.fence`` and
``lease.outcome``, on the span of the run it belongs to:

- in the thread running the task, that is the run's span (the current span at the first
  lease signal of the delivery, which fires in the gate before the body);
- on the heartbeat's threads (``lease.lapse``), on the span of the run that claimed that
  lease, remembered by (key, token) from the claim to ``task_postrun``;
- after the run's span ended (a fire-and-forget task's finish, written behind its return; a
  lapse while settling), on a short span of its own named after the event, a child of the
  run's span; the last :data:`RECENT_RUNS` ended runs are remembered for that;
- the sweeper, which has no run, gives each re-published key a short ``lease.sweep`` span.

A re-published delivery (a deferred duplicate, the sweeper's re-publish, a requeue) carries a
:data:`LINK_HEADER` message header: the W3C ``traceparent`` of the delivery it re-publishes, the
deferring run's span, or, from the lease row, the recorded message's trace context. The new
run's span gets a span link to it. Lease keys appear in span attributes only, never in metric
labels (``lease_celery.metrics`` labels by task name).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from celery import current_task
from celery import signals as celery_signals

from . import signals
from .execution import delivery
from .extras import needs

with needs("lease_celery.otel", "opentelemetry-api", extra="otel"):
    from opentelemetry import trace
    from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext, TracerProvider
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    from opentelemetry.util.types import AttributeValue

__all__ = ["EVENTS", "LINK_HEADER", "RECENT_RUNS", "instrument", "is_instrumented",
           "uninstrument"]

logger = logging.getLogger(__name__)

#: Message header of a re-published delivery: the ``traceparent`` of the one it re-publishes.
LINK_HEADER = "lease_republished_from"
#: How many ended runs' span contexts are kept for events that arrive after the run's end.
RECENT_RUNS = 1024

#: lease_celery signal -> (span event name, ``lease.outcome``). ``lease_renewed`` (one per
#: heartbeat interval: it would flood long runs' spans) and ``lease_settled`` (after the run's
#: span ended: a span more per task) are left out.
EVENTS: dict[str, tuple[str, str]] = {
    "lease_acquired": ("lease.claim", "claimed"),
    "lease_taken_over": ("lease.takeover", "taken_over"),
    "lease_lost": ("lease.lapse", "lost"),
    "stale_result_rejected": ("lease.stale_refused", "refused"),
    "effect_performed": ("lease.effect_performed", "performed"),
    "effect_replayed": ("lease.effect_replayed", "replayed"),
    "effect_conflict": ("lease.effect_conflict", "conflict"),
    "effect_outcome_unknown": ("lease.effect_outcome_unknown", "unknown"),
    "duplicate_deferred": ("lease.defer", "deferred"),
    "duplicate_ignored": ("lease.duplicate_ignored", "ignored"),
    "duplicate_answered": ("lease.answer", "answered"),
    "lease_swept": ("lease.sweep_republish", "republished"),
    "lease_finished": ("lease.finish", "accepted"),
    "lease_released": ("lease.release", "released"),
    "lease_retry": ("lease.retry", "retry"),
    "lease_dead": ("lease.dead", "dead"),
    "settle_completed": ("lease.settle_completed", "completed"),
    "limit_wait": ("lease.limit_wait", "waiting"),
}
_EFFECTS = {"effect_performed", "effect_replayed", "effect_conflict", "effect_outcome_unknown"}
#: Signal keywords copied onto the event as ``lease.<name>``.
_FIELDS = ("reason", "countdown", "holder", "state", "attempt", "group")
_MAX_TEXT = 1000
_STASH = "_lease_otel_run"  # attribute of a delivery's Celery request: its _Run
_propagator = TraceContextTextMapPropagator()


@dataclass
class _Run:
    """The run span of one delivery and the leases claimed under it."""

    span: Span
    claims: set[tuple[str, int]] = field(default_factory=set)


# Plain dict operations only (atomic under the GIL): no lock for a fork or a green pool to
# leave held. (key, token) of a claim -> the span of the run holding it, until task_postrun.
_live: dict[tuple[str, int], Span] = {}
# (key, token) -> span context of a run that ended, the latest RECENT_RUNS.
_ended: OrderedDict[tuple[str, int], SpanContext] = OrderedDict()
_state: dict[str, Any] = {"tracer": None}


def instrument(*, tracer_provider: TracerProvider | None = None) -> None:
    """Turn lease signals into span events and link re-published deliveries; idempotent.

    Call it in every worker process, parent included (the sweeper runs there): at import of
    the app module, or in ``worker_init`` and ``worker_process_init``. ``tracer_provider``
    (default: the global one) makes the spans this module opens itself (``lease.sweep``, and
    those of events after their run's end); events go on spans made by whoever made them.
    """
    _state["tracer"] = trace.get_tracer(__name__, tracer_provider=tracer_provider)
    for name in EVENTS:
        getattr(signals, name).connect(_RECEIVERS[name], weak=False,
                                       dispatch_uid=f"lease_celery.otel.{name}")
    celery_signals.task_postrun.connect(_forget_run, weak=False,
                                        dispatch_uid="lease_celery.otel.task_postrun")
    delivery.republish_headers.connect(_link_headers, weak=False, dispatch_uid=_LINK_UID)


def uninstrument() -> None:
    """Disconnect everything :func:`instrument` connected (tests)."""
    for name in EVENTS:
        getattr(signals, name).disconnect(dispatch_uid=f"lease_celery.otel.{name}")
    celery_signals.task_postrun.disconnect(dispatch_uid="lease_celery.otel.task_postrun")
    delivery.republish_headers.disconnect(dispatch_uid=_LINK_UID)
    _state["tracer"] = None
    _clear()


def is_instrumented() -> bool:
    return any(lookup[0] == _LINK_UID for lookup, _ in delivery.republish_headers.receivers)


_LINK_UID = "lease_celery.otel.republish_headers"


# -- which span an event goes on ----------------------------------------------------------------


def _run_of(task: Any) -> _Run | None:
    """The run of the delivery ``task`` is executing in this thread, bound on its first lease
    signal (in the gate, where the current span is the run's), with the link it carries."""
    request = getattr(task, "request", None)
    if request is None:
        return None
    run: _Run | None = getattr(request, _STASH, None)
    if run is not None:
        return run
    if getattr(request, "called_directly", True) or not getattr(request, "id", None):
        return None  # no delivery (a direct call), or another thread than the run's
    span = trace.get_current_span()
    if not span.is_recording():
        return None
    run = _Run(span)
    setattr(request, _STASH, run)
    linked = _parse(getattr(request, LINK_HEADER, None))
    if linked is not None:
        span.add_link(linked, {"lease.link": "republished_from"})
    return run


def _emit(name: str, task: Any, attributes: dict[str, AttributeValue],
          claim: tuple[str, int] | None) -> None:
    run = _run_of(task)
    if run is not None:
        if claim is not None and claim not in run.claims:
            run.claims.add(claim)
            _live[claim] = run.span
        if run.span.is_recording():
            run.span.add_event(name, attributes)
        else:  # a finish written behind the return, after the run's span ended
            _late(name, attributes, run.span.get_span_context())
        return
    current = trace.get_current_span()
    if current.is_recording():  # a direct call under a span of the caller's
        current.add_event(name, attributes)
        return
    if claim is None:
        return
    span = _live.get(claim)
    if span is not None and span.is_recording():  # the heartbeat's threads
        span.add_event(name, attributes)
        return
    context = span.get_span_context() if span is not None else _ended.get(claim)
    if context is not None:
        _late(name, attributes, context)
    # Otherwise no run span is known for it (no tracing around this run): dropped.


def _late(name: str, attributes: dict[str, AttributeValue], parent: SpanContext) -> None:
    """An event after its run's span ended: a short span of its own, a child of the run's."""
    tracer = _state["tracer"]
    if tracer is None or not parent.is_valid:
        return
    span = tracer.start_span(name, context=trace.set_span_in_context(NonRecordingSpan(parent)))
    span.add_event(name, attributes)
    span.end()


def _forget_run(sender: Any = None, task: Any = None, **_: Any) -> None:
    """task_postrun: the run's claims are no longer looked up by (key, token) as live."""
    request = getattr(task or sender, "request", None)
    run: _Run | None = getattr(request, _STASH, None)
    if run is None:
        return
    context = run.span.get_span_context()
    for claim in run.claims:
        _live.pop(claim, None)
        _ended[claim] = context
    while len(_ended) > RECENT_RUNS:
        try:
            _ended.popitem(last=False)
        except KeyError:  # trimmed by another thread meanwhile
            break


def _clear() -> None:
    _live.clear()
    _ended.clear()


os.register_at_fork(after_in_child=_clear)  # a child's runs are its own


# -- receivers ----------------------------------------------------------------------------------


def _attributes(outcome: str, key: str | None, fields: Mapping[str, Any],
                lease: Any) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {"lease.outcome": outcome}
    if key is not None:
        attributes["lease.key"] = key
    if lease is not None:
        attributes["lease.token"] = int(lease.token)
        attributes["lease.fence"] = int(getattr(lease, "fence", 0) or 0)
    for name in _FIELDS:
        value = fields.get(name)
        if isinstance(value, (bool, int, float)):
            attributes[f"lease.{name}"] = value
        elif value is not None:
            attributes[f"lease.{name}"] = str(getattr(value, "value", value))[:_MAX_TEXT]
    return attributes


def _lease_receiver(signal_name: str) -> Any:
    event, outcome = EVENTS[signal_name]

    def receive(sender: Any = None, key: str | None = None, **fields: Any) -> None:
        lease, record = fields.get("lease"), fields.get("record")
        # The event's generation: the lease's, unless it is of another key (an answer's).
        source = lease if lease is not None and lease.key == key else record or lease
        attributes = _attributes(outcome, key, fields, source)
        if lease is not None:
            if lease.key != key:
                attributes["lease.answer_key"] = lease.key
            if signal_name == "lease_acquired":
                attributes["lease.attempts"] = int(lease.attempts)
                attributes["lease.takeovers"] = int(lease.takeovers)
                attributes["lease.owner"] = str(lease.owner)
        refusal = fields.get("refusal")
        if refusal is not None:  # limit_wait: where the delivery stands in its group
            attributes["lease.waiting"] = int(refusal.waiting)
            attributes["lease.running"] = int(refusal.running)
            if refusal.limit is not None:
                attributes["lease.limit"] = int(refusal.limit)
        claim = (lease.key, int(lease.token)) if lease is not None else None
        _emit(event, sender, attributes, claim)

    return receive


def _effect_receiver(signal_name: str) -> Any:
    event, outcome = EVENTS[signal_name]

    def receive(sender: Any = None, key: str | None = None, **fields: Any) -> None:
        # Sent by the store inside the body: the lease is the current task's.
        task = _current_task()
        # Its execution's lease: key, token and fence.
        execution = getattr(getattr(task, "request", None), "lease", None)
        lease = getattr(execution, "lease", None)
        attributes = _attributes(outcome, getattr(lease, "key", None), fields, lease)
        if key is not None:
            attributes["lease.effect_key"] = key
        _emit(event, task, attributes, None)

    return receive


def _swept(sender: Any = None, key: str | None = None, record: Any = None,
           **fields: Any) -> None:
    """A re-publish by the sweeper: an event on the current run's span (the
    ``lease_celery.sweep`` task), else on a short ``lease.sweep`` span of its own, linked to
    the delivery the row recorded."""
    event, outcome = EVENTS["lease_swept"]
    attributes = _attributes(outcome, key, {"state": getattr(record, "state", None)}, record)
    task_id = getattr(record, "task_id", None)
    if task_id:
        attributes["lease.task_id"] = str(task_id)
    if trace.get_current_span().is_recording():
        _emit(event, _current_task(), attributes, None)
        return
    tracer = _state["tracer"]
    if tracer is None:
        return
    linked = _parse(_recorded_headers(getattr(record, "task", None)).get("traceparent"))
    links = [Link(linked, {"lease.link": "republished_from"})] if linked is not None else None
    span = tracer.start_span("lease.sweep", links=links, attributes={"lease.key": key or ""})
    span.add_event(event, attributes)
    span.end()


_RECEIVERS: dict[str, Any] = {
    name: (_effect_receiver(name) if name in _EFFECTS else _lease_receiver(name))
    for name in EVENTS}
_RECEIVERS["lease_swept"] = _swept


# -- the link header ----------------------------------------------------------------------------


def _link_headers(sender: Any = None, headers: Mapping[str, Any] | None = None,
                  **_: Any) -> Mapping[str, Any]:
    """On ``delivery.republish_headers``: the header naming the delivery being re-published.

    In a run (a deferred duplicate), the run's own span; elsewhere (sweeper, requeue), the
    trace context the re-published delivery's message carried, as the lease row recorded it.
    Never raises: a re-publish must not fail for tracing.
    """
    try:
        run = _run_of(_current_task())
        span = run.span if run is not None else trace.get_current_span()
        context = span.get_span_context()
        if context.is_valid:
            carrier: dict[str, str] = {}
            _propagator.inject(carrier, trace.set_span_in_context(NonRecordingSpan(context)))
            if "traceparent" in carrier:
                return {LINK_HEADER: carrier["traceparent"]}
        parent = (headers or {}).get("traceparent")
        if isinstance(parent, str) and _parse(parent) is not None:
            return {LINK_HEADER: parent}
    except Exception:
        logger.debug("lease_celery.otel: no link header for a re-publish", exc_info=True)
    return {}


def _parse(traceparent: Any) -> SpanContext | None:
    if not isinstance(traceparent, str):
        return None
    context = trace.get_current_span(
        _propagator.extract({"traceparent": traceparent})).get_span_context()
    return context if context.is_valid else None


def _recorded_headers(info: Any) -> Mapping[str, Any]:
    options = info.get("options") if isinstance(info, Mapping) else None
    headers = options.get("headers") if isinstance(options, Mapping) else None
    return headers if isinstance(headers, Mapping) else {}


def _current_task() -> Any:
    try:
        return current_task._get_current_object()
    except Exception:  # no task in this thread
        return None
