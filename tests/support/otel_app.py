"""tests/support/worker_app.py's app and tasks, traced: the worker app of
tests/workers/test_otel.py.

The OpenTelemetry SDK exports every finished span as one JSON line to a Redis list of the
test's own (``LEASE_TEST_OTEL_SPANS``, on the journal's Redis): an in-memory exporter cannot be
read across processes. opentelemetry-instrumentation-celery is enabled in each pool process
(``worker_process_init``, as its documentation says for prefork); ``lease_celery.otel`` at
import, so that the worker's main process (the sweeper) has it too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import redis
from celery import signals
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

import lease_celery.otel
from tests.support.worker_app import JOURNAL_REDIS, app

__all__ = ["app"]

SPANS = os.environ.get("LEASE_TEST_OTEL_SPANS", "otel-spans")


def span_json(span: ReadableSpan) -> dict[str, Any]:
    """What the tests read of a finished span (ids as hex strings, as traceparent has them)."""
    context = span.get_span_context()
    assert context is not None
    return {
        "name": span.name, "pid": os.getpid(),
        "trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}",
        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent else None,
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "attributes": dict(e.attributes or {})}
                   for e in span.events],
        "links": [{"trace_id": f"{link.context.trace_id:032x}",
                   "span_id": f"{link.context.span_id:016x}",
                   "attributes": dict(link.attributes or {})} for link in span.links],
    }


class RedisListExporter(SpanExporter):
    """Appends each span as JSON to the ``SPANS`` list (one Redis client per process)."""

    def __init__(self) -> None:
        self._client: redis.Redis | None = None
        self._pid = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._client is None or self._pid != os.getpid():
            self._client, self._pid = redis.Redis.from_url(JOURNAL_REDIS), os.getpid()
        self._client.rpush(SPANS, *(json.dumps(span_json(s), default=str) for s in spans))
        return SpanExportResult.SUCCESS


provider = TracerProvider(resource=Resource.create({"service.name": "lease-otel-tests"}))
provider.add_span_processor(SimpleSpanProcessor(RedisListExporter()))
trace.set_tracer_provider(provider)  # inherited by the pool processes (no thread to lose)
lease_celery.otel.instrument()


@signals.worker_process_init.connect(weak=False)
def _instrument_celery(**_: Any) -> None:
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    CeleryInstrumentor().instrument()
