"""OpenTelemetry: lease events on the run spans, links across re-publishes, keys out of labels.

In process, with the SDK's in-memory exporter and opentelemetry-instrumentation-celery around
eager runs; then real prefork ``celery worker`` processes (tests/support/otel_app.py) exporting
their
spans as JSON lines to a Redis list of the test's own, on a Redis database of this module's own
(``LEASE_TEST_OTEL_REDIS_DB``, default 15), so a concurrent run that flushes the suite's
database does not reach it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery import signals as celery_signals
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lease_celery import LeasedTask, LimitRefused, metrics, open_store, otel, signals
from lease_celery.execution import delivery
from lease_celery.testing import ManualClock
from lease_celery.worker.sweeper import sweep
from tests.support.servers import REDIS_HOST, REDIS_PORT, require
from tests.support.workers import Journal, Worker, WorkerPool, client_app

#: A traceparent as an instrumented publisher would have sent it.
TRACE_ID, SPAN_ID = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{SPAN_ID}-01"


def _events(span: ReadableSpan | dict[str, Any], name: str) -> list[dict[str, Any]]:
    events = span["events"] if isinstance(span, dict) else [
        {"name": e.name, "attributes": dict(e.attributes or {})} for e in span.events]
    return [e["attributes"] for e in events if e["name"] == name]


# -- in process: eager runs under the instrumentation ------------------------------------------



#: This module's own tracer provider (the global one is left alone), and what it exported.
PROVIDER = TracerProvider()
MEMORY = InMemorySpanExporter()
PROVIDER.add_span_processor(SimpleSpanProcessor(MEMORY))


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The instrumentation and lease_celery.otel on this module's provider, for this test only
    (the worker tests' client and the rest of the suite run untraced)."""
    MEMORY.clear()
    CeleryInstrumentor().instrument(tracer_provider=PROVIDER)
    otel.instrument(tracer_provider=PROVIDER)
    otel.instrument(tracer_provider=PROVIDER)  # idempotent
    try:
        yield MEMORY
    finally:
        otel.uninstrument()
        CeleryInstrumentor().uninstrument()


@pytest.fixture
def app(tmp_path: Path) -> Celery:
    app = Celery(f"otel-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    app.conf.lease_store_url = f"sqlite:///{tmp_path}/leases.sqlite3"
    app.conf.lease_ttl = 5
    return app


def test_eager_run_span_gets_claim_effect_and_finish_events_once(app: Celery,
                                                                 spans: Any) -> None:
    """Every lease signal of a run becomes one event on the instrumentation's run span, with
    lease.key, lease.token, lease.fence and lease.outcome (instrument() twice: still once)."""

    @app.task(base=LeasedTask, bind=True, lease_key="report:{n}", shared=False)
    def report(self: LeasedTask, n: int) -> int:
        self.effect(f"publish:{n}", {"n": n}, lambda key: "sent")
        self.effect(f"publish:{n}", {"n": n}, lambda key: "sent")
        return n

    assert report.apply((7,)).get() == 7
    (run,) = [s for s in spans.get_finished_spans() if s.name.startswith("run/")]
    lease = open_store(app.conf.lease_store_url).get("report:7")
    assert lease is not None
    (claim,) = _events(run, "lease.claim")
    assert claim["lease.key"] == "report:7" and claim["lease.token"] == 1
    assert claim["lease.fence"] == lease.fence > 0 and claim["lease.outcome"] == "claimed"
    (performed,) = _events(run, "lease.effect_performed")
    (replayed,) = _events(run, "lease.effect_replayed")
    for event, outcome in ((performed, "performed"), (replayed, "replayed")):
        assert event["lease.effect_key"] == "publish:7" and event["lease.key"] == "report:7"
        assert event["lease.token"] == 1 and event["lease.outcome"] == outcome
    (finish,) = _events(run, "lease.finish")
    assert finish["lease.outcome"] == "accepted" and finish["lease.token"] == 1
    assert not otel._live  # the run's claims are dropped at task_postrun


def test_a_parked_delivery_gets_a_limit_wait_event_with_its_group(app: Celery,
                                                                  spans: Any) -> None:
    """``limit_wait`` (the gate parks a delivery over its group's limit) becomes a
    ``lease.limit_wait`` event on the run's span, with the group and where it stands."""
    refusal = LimitRefused(group="tenant:<1>", reason="limit", parked=True, waiting=3,
                           running=2, limit=2)

    @app.task(base=LeasedTask, bind=True, lease_key="job:{n}", shared=False)
    def job(self: LeasedTask, n: int) -> int:
        signals.limit_wait.send(sender=self, key="job:1", group=refusal.group,
                                refusal=refusal)
        return n

    job.apply((1,)).get()
    (run,) = [s for s in spans.get_finished_spans() if s.name.startswith("run/")]
    assert _events(run, "lease.limit_wait") == [{
        "lease.outcome": "waiting", "lease.key": "job:1", "lease.group": "tenant:<1>",
        "lease.waiting": 3, "lease.running": 2, "lease.limit": 2}]


def test_lapse_from_another_thread_lands_on_the_run_span(app: Celery, spans: Any) -> None:
    """lease_lost sent from another thread (as the heartbeat sends it) during the run goes on
    the run's span; once the run ended, such an event gets a short span, a child of it."""
    leases: list[Any] = []

    def lose(lease: Any) -> None:
        thread = threading.Thread(target=lambda: signals.lease_lost.send(
            sender=None, key=lease.key, lease=lease, reason="renewal refused"))
        thread.start()
        thread.join()

    @app.task(base=LeasedTask, bind=True, lease_key="job:{n}", shared=False)
    def job(self: LeasedTask, n: int) -> int:
        leases.append(self.request.lease.lease)
        lose(self.request.lease.lease)
        return n

    job.apply((1,)).get()
    lose(leases[0])  # after task_postrun: the run's span has ended
    finished = spans.get_finished_spans()
    (run,) = [s for s in finished if s.name.startswith("run/")]
    (lapse,) = _events(run, "lease.lapse")
    assert lapse == {"lease.outcome": "lost", "lease.key": "job:1", "lease.token": 1,
                     "lease.fence": leases[0].fence, "lease.reason": "renewal refused"}
    (late,) = [s for s in finished if s.name == "lease.lapse"]
    assert late.parent is not None and late.parent.span_id == run.context.span_id
    assert _events(late, "lease.lapse") == [lapse]
    assert not otel._live


def test_sweep_republish_has_its_own_span_and_carries_the_link(app: Celery, spans: Any,
                                                               tmp_path: Path) -> None:
    """With no run span, a sweep re-publish is an event on a short lease.sweep span linked to
    the recorded delivery's trace context, and the message carries that context as the link
    header; without instrument(), a re-publish is unchanged."""
    clock = ManualClock(1000.0)
    store = open_store(f"sqlite:///{tmp_path}/swept.sqlite3", clock=clock)
    info = {"task": "tests.nothing", "args": [1], "kwargs": {},
            "options": {"task_id": "t-1", "headers": {"traceparent": TRACEPARENT}}}
    lease = store.claim("swept:1", owner="dead-owner", ttl=1, task=info)
    assert lease is not None
    clock.advance(2)
    published: list[dict[str, Any]] = []

    def capture(headers: dict[str, Any] | None = None, **_: Any) -> None:
        published.append(dict(headers or {}))

    celery_signals.before_task_publish.connect(capture, weak=False)
    try:
        assert [r.key for r in sweep(app, store, grace=0)] == ["swept:1"]
        assert published[-1][otel.LINK_HEADER] == TRACEPARENT
        otel.uninstrument()
        try:
            delivery.republish(app, info)
            assert otel.LINK_HEADER not in published[-1]
        finally:
            otel.instrument(tracer_provider=PROVIDER)
    finally:
        celery_signals.before_task_publish.disconnect(capture)
    (swept,) = [s for s in spans.get_finished_spans() if s.name == "lease.sweep"]
    assert [(f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}")
            for link in swept.links] == [(TRACE_ID, SPAN_ID)]
    (event,) = _events(swept, "lease.sweep_republish")
    assert event["lease.key"] == "swept:1" and event["lease.token"] == 1
    assert event["lease.fence"] == lease.fence and event["lease.outcome"] == "republished"
    assert event["lease.task_id"] == "t-1"


def test_metric_labels_never_carry_a_lease_key(app: Celery, spans: Any) -> None:
    """Keys go on span attributes only: lease_celery.metrics labels its figures by task name,
    in its snapshot and in Prometheus, so no label value is ever a key (cardinality)."""
    from prometheus_client import REGISTRY

    @app.task(base=LeasedTask, bind=True, lease_key="cardinality:{n}", shared=False)
    def labelled(self: LeasedTask, n: int) -> int:
        self.effect(f"effect:{n}", n, lambda key: n)
        return n

    keys = set()
    for n in range(5):
        labelled.apply((n,)).get()
        keys |= {f"cardinality:{n}", f"effect:{n}"}
    snapshot = metrics.snapshot()
    assert snapshot["totals"]["claims"] >= 5
    labels = {task for per_task in snapshot["counters"].values() for task in per_task}
    labels |= {value for family in REGISTRY.collect() if family.name.startswith("lease_celery")
               for sample in family.samples for value in sample.labels.values()}
    assert labelled.name in labels
    assert not labels & keys
    run_keys = {e["lease.key"] for s in spans.get_finished_spans()
                for e in _events(s, "lease.claim")}
    assert run_keys == {f"cardinality:{n}" for n in range(5)}  # ... and they are on spans


# -- real workers ------------------------------------------------------------------------------

OTEL_REDIS_DB = int(os.environ.get("LEASE_TEST_OTEL_REDIS_DB", "15"))
BROKER = f"redis://{REDIS_HOST}:{REDIS_PORT}/{OTEL_REDIS_DB}"
WORK, UNCHECKED, QUIET = ("tests.support.worker_app.work", "tests.support.worker_app.unchecked",
                          "tests.support.worker_app.quiet")


class TracedWorkers(WorkerPool):
    """Real ``celery -A tests.support.otel_app worker`` processes, their journal and their spans."""

    def __init__(self, tmp: Path, client: redis.Redis, env: dict[str, str]) -> None:
        super().__init__(tmp=tmp, env=env, journal=Journal(client, env["LEASE_TEST_JOURNAL"]))
        self.redis = client
        self.client = client_app(BROKER, env["LEASE_TEST_QUEUE"])

    def start(self, name: str, *, concurrency: int = 2, **options: Any) -> Worker:
        return super().start(name, concurrency=concurrency, app="tests.support.otel_app", **options)

    def spans(self) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.redis.lrange(self.env["LEASE_TEST_OTEL_SPANS"],
                                                             0, -1)]

    def wait_for_spans(self, predicate: Callable[[list[dict[str, Any]]], bool], *,
                       what: str, timeout: float = 20) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while not predicate(spans := self.spans()):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; spans:\n"
                                     + "\n".join(map(str, spans)))
            time.sleep(0.05)
        return spans

    def runs(self, task_id: str) -> list[dict[str, Any]]:
        """The run spans (opentelemetry-instrumentation-celery's) of deliveries of task_id."""
        return [s for s in self.spans() if s["name"].startswith("run/")
                and s["attributes"].get("messaging.message.id") == task_id]


@pytest.fixture
def traced(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TracedWorkers]:
    client = redis.Redis.from_url(BROKER, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        require("Redis", False, f"{BROKER}: {exc}")
    run = uuid.uuid4().hex[:8]
    env = {"LEASE_TEST_BROKER": BROKER, "LEASE_TEST_QUEUE": f"lease-otel-{run}",
           "LEASE_TEST_JOURNAL": f"lease-otel-journal-{run}",
           "LEASE_TEST_OTEL_SPANS": f"lease-otel-spans-{run}",
           "LEASE_TEST_STORE": f"sqlite:///{tmp_path}/leases.sqlite3",
           "LEASE_TEST_TTL": "1.5", "LEASE_TEST_HEARTBEAT": "0.4"}
    pool = TracedWorkers(tmp_path, client, env)
    try:
        yield pool
        if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
            print(pool.logs())
    finally:
        for worker in pool.workers:
            worker.stop()
        for key in client.scan_iter(f"*{run}*"):
            client.delete(key)


def _linked(span: dict[str, Any], span_id: str) -> bool:
    return any(link["span_id"] == span_id
               and link["attributes"].get("lease.link") == "republished_from"
               for link in span["links"])


@pytest.mark.worker
def test_worker_run_spans_claim_defer_link_and_background_finish(
        traced: TracedWorkers) -> None:
    """A real run's span has lease.claim with the attributes; a duplicate delivered meanwhile
    is deferred (lease.defer on its run's span), and each re-published run of it has a span
    link to the run that deferred it; a fire-and-forget task's finish, written behind its
    return, lands on its run's span or on a child span of it."""
    traced.start("a", concurrency=2)
    job, task_id = uuid.uuid4().hex[:10], str(uuid.uuid4())
    result = traced.client.send_task(WORK, args=(job, 2.0), task_id=task_id)
    traced.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                            what="the first run to start")
    traced.client.send_task(WORK, args=(job, 2.0), task_id=task_id)
    quiet_job, quiet_id = uuid.uuid4().hex[:10], str(uuid.uuid4())
    traced.client.send_task(QUIET, args=(quiet_job,), task_id=quiet_id)
    assert result.get(timeout=20)["token"] == 1
    key = f"job:{job}"
    traced.journal.wait_for(lambda j: bool(j.events("duplicate_ignored", key=key)),
                            timeout=20, what="the duplicate to come back and be ignored")
    traced.wait_for_spans(lambda _: any(_events(s, "lease.duplicate_ignored")
                                        for s in traced.runs(task_id)),
                          what="the ignored run's span")
    runs = traced.runs(task_id)
    (claimed,) = [s for s in runs if _events(s, "lease.claim")]
    (claim,) = _events(claimed, "lease.claim")
    with open_store(traced.env["LEASE_TEST_STORE"]) as store:
        record = store.get(key)
    assert record is not None
    assert claim["lease.key"] == key and claim["lease.token"] == 1
    assert claim["lease.fence"] == record.fence and claim["lease.outcome"] == "claimed"
    assert _events(claimed, "lease.finish")[0]["lease.token"] == 1
    deferring = [s for s in runs if _events(s, "lease.defer")]
    assert deferring
    for run in deferring:
        (defer,) = _events(run, "lease.defer")
        assert defer["lease.key"] == key and defer["lease.outcome"] == "deferred"
        assert defer["lease.countdown"] > 0
        # Its re-published delivery's run links back to it (and to no other run).
        assert len([s for s in runs if _linked(s, run["span_id"])]) == 1
    (ignored,) = [s for s in runs if _events(s, "lease.duplicate_ignored")]
    assert _events(ignored, "lease.duplicate_ignored")[0]["lease.token"] == 1
    assert any(_linked(ignored, run["span_id"]) for run in deferring)
    assert not claimed["links"]  # the first delivery re-published nothing
    spans = traced.wait_for_spans(
        lambda spans: any(_events(s, "lease.finish") and s["name"] == "lease.finish"
                          for s in spans) or any(_events(s, "lease.finish")
                                                 for s in traced.runs(quiet_id)),
        what="the fire-and-forget finish")
    (quiet_run,) = traced.runs(quiet_id)
    finishes = _events(quiet_run, "lease.finish") + [
        e for s in spans if s["name"] == "lease.finish"
        and s["parent_span_id"] == quiet_run["span_id"] for e in _events(s, "lease.finish")]
    assert [f["lease.key"] for f in finishes] == [f"job:{quiet_job}"]


@pytest.mark.worker
def test_worker_takeover_after_sigkill_via_the_sweeper(traced: TracedWorkers) -> None:
    """The worker running a task is SIGKILLed; the survivor's sweeper re-publishes it (a
    lease.sweep span linked to the delivery the row recorded) and the new run's span shows
    lease.takeover and a link to that delivery."""
    doomed = traced.start("doomed", concurrency=1)
    job, task_id = uuid.uuid4().hex[:10], str(uuid.uuid4())
    # Published as an instrumented client would: with a traceparent header.
    traced.client.send_task(WORK, args=(job, 3.0), task_id=task_id,
                            headers={"traceparent": TRACEPARENT})
    traced.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                            what="the doomed worker to start the task")
    doomed.kill()
    traced.start("survivor", concurrency=1)
    key = f"job:{job}"
    spans = traced.wait_for_spans(
        lambda _: any(_events(s, "lease.takeover") for s in traced.runs(task_id)),
        what="the takeover's run span", timeout=30)
    (run,) = [s for s in traced.runs(task_id) if _events(s, "lease.takeover")]
    (takeover,) = _events(run, "lease.takeover")
    assert takeover["lease.key"] == key and takeover["lease.token"] == 2
    assert takeover["lease.outcome"] == "taken_over" and takeover["lease.fence"] > 0
    assert _events(run, "lease.claim")[0]["lease.token"] == 2
    assert _linked(run, SPAN_ID)
    (swept,) = [s for s in spans if s["name"] == "lease.sweep"
                and s["attributes"].get("lease.key") == key]
    (event,) = _events(swept, "lease.sweep_republish")
    assert event["lease.token"] == 1 and event["lease.outcome"] == "republished"
    assert event["lease.task_id"] == task_id
    assert [(link["trace_id"], link["span_id"]) for link in swept["links"]] == [
        (TRACE_ID, SPAN_ID)]
    assert swept["pid"] != run["pid"]  # the survivor's main process, not its pool process


@pytest.mark.worker
def test_worker_stalled_owner_lapse_and_stale_refusal(traced: TracedWorkers) -> None:
    """An owner stalled past its ttl (SIGSTOP … SIGCONT) while another run took the key over:
    its heartbeat's lapse and its refused result are events on its own run's span."""
    traced.start("a", concurrency=2)
    job, task_id = uuid.uuid4().hex[:10], str(uuid.uuid4())
    traced.client.send_task(UNCHECKED, args=(job, 6.0), task_id=task_id)
    traced.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                            what="the first owner to start")
    stalled_pid = traced.journal.events("body_start", job_id=job)[0]["pid"]
    os.kill(stalled_pid, signal.SIGSTOP)
    try:
        traced.client.send_task(UNCHECKED, args=(job, 0.2), task_id=task_id)
        traced.journal.wait_for(lambda j: bool(j.events("body_end", job_id=job, token=2)),
                                timeout=20, what="the takeover to finish")
    finally:
        os.kill(stalled_pid, signal.SIGCONT)
    key = f"job:{job}"
    traced.wait_for_spans(lambda _: any(_events(s, "lease.stale_refused")
                                        for s in traced.runs(task_id)),
                          what="the stale owner's run span", timeout=15)
    runs = traced.runs(task_id)
    (stale,) = [s for s in runs if _events(s, "lease.stale_refused")]
    assert stale["pid"] == stalled_pid
    (refused,) = _events(stale, "lease.stale_refused")
    assert refused["lease.key"] == key and refused["lease.token"] == 1
    assert refused["lease.outcome"] == "refused" and refused["lease.fence"] > 0
    # Sent by the heartbeat's thread, found by (key, token) on the run's span.
    (lapse,) = _events(stale, "lease.lapse")
    assert lapse["lease.token"] == 1 and lapse["lease.outcome"] == "lost"
    assert _events(stale, "lease.claim")[0]["lease.token"] == 1
    (fresh,) = [s for s in runs if _events(s, "lease.takeover")]
    assert _events(fresh, "lease.takeover")[0]["lease.token"] == 2
