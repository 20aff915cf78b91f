"""Metrics: every signal has a counter; eager runs move the in-process figures
(``lease_celery.metrics.snapshot()``); a real worker's takeovers and refused stale results are
scraped from its Prometheus endpoint (``lease_metrics_port``, ``PROMETHEUS_MULTIPROC_DIR``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from lease_celery import (
    EffectOutcomeUnknown,
    Lease,
    LeasedTask,
    Waiter,
    install,
    metrics,
    open_store,
    signals,
)
from lease_celery.worker.sweeper import sweep
from tests.support.policy_helpers import free_port, scrape, wait_until
from tests.support.workers import WorkerPool


def test_every_signal_has_a_counter_and_moves_it() -> None:
    """Each signal in ``lease_celery.signals.__all__`` maps to its own counter in
    ``metrics.COUNTERS`` (and nothing else does); histogram sources are real signals; sending a
    signal adds one to its counter; with prometheus_client each counter and histogram exists
    as a Prometheus metric (once ``install()`` connected the counters, as binding a LeasedTask
    does)."""
    install()
    assert set(metrics.COUNTERS) == set(signals.__all__)
    assert len(set(metrics.COUNTERS.values())) == len(metrics.COUNTERS)
    for sources, _ in metrics.HISTOGRAMS.values():
        assert set(sources) <= set(signals.__all__)
    before = metrics.snapshot()["totals"]
    for name in signals.__all__:
        getattr(signals, name).send(sender=None, key="metrics-test")
    after = metrics.snapshot()["totals"]
    assert {name: after[name] - before[name] for name in after} == {
        name: 1 for name in metrics.COUNTERS.values()}
    assert set(metrics._prometheus_metrics()) == (set(metrics.COUNTERS.values())
                                                  | set(metrics.HISTOGRAMS)
                                                  | set(metrics.GAUGES))


def test_limit_gauges_count_running_and_waiting_per_task_name() -> None:
    """A limited lease held moves ``limit_running`` of its task until its hold ends (once,
    however many end signals follow); a parked delivery moves ``limit_waiting`` until it is
    handed on, counted under the waiter's task name; a lease without a group moves nothing.
    Groups are never labels."""
    install()
    metrics.reset()

    class Task:
        name = "proj.export"

    lease = Lease("k1", "w", 1, 10.0, group="tenant:1", slot=1)
    signals.lease_acquired.send(sender=Task(), key="k1", lease=lease)
    signals.lease_acquired.send(sender=Task(), key="k0", lease=Lease("k0", "w", 1, 10.0))
    assert metrics.snapshot()["gauges"]["limit_running"] == {"proj.export": 1}
    signals.limit_wait.send(sender=Task(), key="k2", group="tenant:1", refusal=None)
    assert metrics.snapshot()["gauges"]["limit_waiting"] == {"proj.export": 1}
    waiter = Waiter("tenant:1", "k2", {"task": "proj.export"}, 1.0)
    signals.limit_handed_on.send(sender=None, key="k2", group="tenant:1", waiter=waiter)
    signals.stale_result_rejected.send(sender=Task(), key="k1", lease=lease)
    signals.lease_lost.send(sender=Task(), key="k1", lease=lease)
    gauges = metrics.snapshot()["gauges"]
    assert gauges == {"limit_running": {"proj.export": 0}, "limit_waiting": {"proj.export": 0}}
    assert metrics.snapshot()["counters"]["limit_handed_on"] == {"proj.export": 1}


def _app(store_url: str) -> Celery:
    app = Celery("metrics", broker="memory://", set_as_current=False)
    # lease_retry_errors: the opt-in error retries, so that a retry and a release are counted.
    app.conf.update(lease_store_url=store_url, lease_ttl=0.3, lease_heartbeat_interval=0.1,
                    lease_max_attempts=2, lease_retry_errors=True)
    return app


def test_snapshot_counts_eager_runs(sqlite_url: str) -> None:
    """Eager ``apply()`` runs move the in-process figures exactly: claims, finished, retries,
    releases, dead letters, a duplicate ignored, a takeover, a refused stale result after a lost
    renewal, a sweep, each effect counter; per task name; and the hold, duration and heartbeat
    histograms have observations."""
    app = _app(sqlite_url)
    effect_calls: list[str] = []

    def send(key: str) -> dict[str, str]:
        effect_calls.append(key)
        return {"sent": key}

    @app.task(base=LeasedTask, bind=True, shared=False, lease_key="ok:{n}")
    def ok(self: LeasedTask, n: int) -> Any:
        time.sleep(0.35)  # past three heartbeat intervals: renewals
        return self.effect(f"send:{n}", {"n": n}, send)

    @app.task(base=LeasedTask, bind=True, shared=False, lease_key="effect:{kind}")
    def effect(self: LeasedTask, kind: str) -> Any:
        if kind == "replay":
            return self.effect("send:1", {"n": 1}, send)
        if kind == "conflict":
            return self.effect("send:1", {"n": 2}, send)

        def unknown(key: str) -> None:
            raise EffectOutcomeUnknown("the target timed out")

        return self.effect("send:unknown", {"n": 3}, unknown)

    @app.task(base=LeasedTask, bind=True, shared=False, lease_key="flaky:{n}")
    def flaky(self: LeasedTask, n: int) -> None:
        raise RuntimeError("always")

    @app.task(base=LeasedTask, bind=True, shared=False, lease_key="stale:{n}")
    def stale(self: LeasedTask, n: int) -> int:
        self.lease_store.force_release(self.lease.key, reason="an operator")
        time.sleep(0.25)  # the next renewal is refused: lease lost
        return n

    @app.task(base=LeasedTask, bind=True, shared=False, lease_key="takeover:{n}")
    def plain(self: LeasedTask, n: int) -> int:
        return self.lease.token

    app.finalize()
    now = time.time()
    with open_store(sqlite_url, clock=lambda: now - 100) as past:
        # Expired long ago: the next claim is a takeover; the second one carries task info
        # for the sweeper.
        assert past.claim("takeover:1", owner="dead-worker", ttl=1) is not None
        assert past.claim("swept:1", owner="dead-worker", ttl=1, task={
            "task": plain.name, "args": [2], "kwargs": {}, "options": {"task_id": "t-1"},
            "subtask_type": None, "immutable": False}) is not None
    metrics.reset()

    assert ok.apply(args=(1,)).get() == {"sent": "send:1"}
    assert ok.apply(args=(1,)).get() == {"sent": "send:1"}  # answered: a duplicate ignored
    assert effect.apply(args=("replay",)).get() == {"sent": "send:1"}
    assert effect.apply(args=("conflict",)).state == "FAILURE"
    assert effect.apply(args=("unknown",)).state == "FAILURE"
    assert flaky.apply(args=(1,)).state == "FAILURE"
    assert stale.apply(args=(1,)).state == "IGNORED"
    assert plain.apply(args=(1,)).get() == 2
    with open_store(sqlite_url) as store:
        assert [r.key for r in sweep(app, store)] == ["swept:1"]
    assert effect_calls == ["send:1"]

    figures = metrics.snapshot()
    totals = figures["totals"]
    renewals = totals.pop("renewals")
    assert renewals >= 2
    assert totals == {
        "claims": 8, "takeovers": 1, "renew_failures": 1, "finished": 3, "releases": 1,
        "retries": 1, "dead_letters": 3, "swept": 1, "duplicates_deferred": 0,
        "duplicates_ignored": 1, "duplicates_answered": 0, "stale_results_refused": 1,
        "effects_performed": 1,
        "effect_replays": 1, "effect_conflicts": 1, "effects_outcome_unknown": 1,
        "settled": 0, "settles_completed": 0,  # eager runs settle at once
        "limit_waits": 0, "limit_handed_on": 0}
    assert figures["counters"]["claims"] == {ok.name: 1, effect.name: 3, flaky.name: 2,
                                             stale.name: 1, plain.name: 1}
    assert figures["counters"]["dead_letters"] == {effect.name: 2, flaky.name: 1}
    histograms = figures["histograms"]
    assert histograms["lease_hold_seconds"]["count"] == 3 + 1 + 3 + 1 + 1
    assert histograms["task_duration_seconds"]["count"] == 3
    assert histograms["task_duration_seconds"]["sum"] >= 0.35
    assert histograms["heartbeat_delay_seconds"]["count"] == renewals
    assert histograms["lease_hold_seconds"]["buckets"]["inf"] == 9


@pytest.mark.worker
@pytest.mark.worker_env(LEASE_TEST_TTL="1.5", LEASE_TEST_HEARTBEAT="0.4")
def test_prometheus_endpoint_counts_takeovers_and_refused_stale_results(
        workers: WorkerPool, tmp_path: Path) -> None:
    """A real worker (two pool processes) serves its metrics on lease_metrics_port, summed over
    its processes through PROMETHEUS_MULTIPROC_DIR. One pool process is stalled (SIGSTOP) past
    its lease; a redelivery is deferred, then takes the key over and finishes; the stalled
    process wakes and its result is refused. The scrape shows claims, takeovers, deferrals,
    finished and the refused stale result."""
    prometheus_dir = tmp_path / "prometheus"
    prometheus_dir.mkdir()
    port = free_port()
    workers.start("a", concurrency=2, extra_env={
        "PROMETHEUS_MULTIPROC_DIR": str(prometheus_dir), "LEASE_TEST_METRICS_PORT": str(port)})
    job, task_id = uuid.uuid4().hex[:10], str(uuid.uuid4())
    workers.client.send_task("tests.support.worker_app.unchecked", args=(job, 1.0), task_id=task_id)
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                             what="the first owner to start")
    stalled_pid = workers.journal.events("body_start", job_id=job)[0]["pid"]
    os.kill(stalled_pid, signal.SIGSTOP)
    try:
        workers.client.send_task("tests.support.worker_app.unchecked", args=(job, 0.2),
                                 task_id=task_id)
        workers.journal.wait_for(lambda j: bool(j.events("body_end", job_id=job, token=2)),
                                 timeout=30, what="the takeover to finish")
    finally:
        os.kill(stalled_pid, signal.SIGCONT)
    workers.journal.wait_for(
        lambda j: bool(j.events("stale_result_rejected", key=f"job:{job}", token=1)),
        timeout=15, what="the stale result to be refused")

    samples = wait_until(
        lambda: (s := scrape(port)).get("lease_celery_stale_results_refused_total", 0) >= 1
        and s, timeout=10, what="the refusal to show in the scrape")
    assert samples["lease_celery_takeovers_total"] >= 1
    assert samples["lease_celery_claims_total"] >= 2
    assert samples["lease_celery_duplicates_deferred_total"] >= 1
    assert samples["lease_celery_finished_total"] >= 1
    assert samples["lease_celery_lease_hold_seconds_count"] >= 2
    assert samples.get("lease_celery_dead_letters_total", 0) == 0


RACE = """
import threading, time
import prometheus_client
from prometheus_client import REGISTRY
real_counter = prometheus_client.Counter
def slow_counter(*args, **kwargs):
    time.sleep(0.01)  # a thread switch while the metrics are being made, made certain
    return real_counter(*args, **kwargs)
prometheus_client.Counter = slow_counter
import lease_celery
from lease_celery import signals
lease_celery.install()  # what binding a LeasedTask does; this script binds none
barrier = threading.Barrier(4)
def claim():
    barrier.wait()
    signals.lease_acquired.send(sender=None, key="k")
threads = [threading.Thread(target=claim) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print(REGISTRY.get_sample_value("lease_celery_claims_total", {"task": ""}))
"""


def test_first_events_recorded_concurrently_all_reach_prometheus() -> None:
    """Four threads of a fresh process record their first claim at the same moment: the
    Prometheus counter shows 4. (The metric constructor is slowed by 10 ms in the subprocess
    to make the thread switch inside first-use creation certain instead of occasional.)"""
    proc = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout.strip().splitlines()[-1]) == 4.0


def test_snapshot_histogram_buckets_count_as_prometheus_does() -> None:
    """Each bound's bucket counts the observations at most that bound (cumulative, ``inf``
    all of them), the same counts prometheus_client's own Histogram gives the same values:
    values on a bound, between bounds, below the first and past the last finite one."""
    from prometheus_client import CollectorRegistry, Histogram

    values = [0.0, 0.005, 0.0051, 0.3, 1.0, 2.6, 299.0, 300.0, 301.0, 1e9]
    ours = metrics._Histogram()
    theirs = Histogram("h", "h", buckets=metrics._BUCKETS, registry=CollectorRegistry())
    for value in values:
        ours.observe(value)
        theirs.observe(value)
    expected = [int(sample.value) for sample in next(iter(theirs.collect())).samples
                if sample.name == "h_bucket"]
    assert ours.buckets == expected
    assert ours.count == len(values) and ours.total == sum(values)
    assert ours.buckets[-1] == len(values) and ours.buckets[0] == 2
