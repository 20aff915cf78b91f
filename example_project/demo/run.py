"""Play the story once per mode, then print the table and draw the timeline."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lease_celery import LeaseError, open_store

from ..receiver import Received, received
from . import picture, scenes
from .brokers import Broker
from .cluster import DemoError, Receiver, Worker, start_receiver, start_worker
from .history import Execution, History
from .stage import Mode, Stage
from .table import render
from .tally import Tally, leased_results, plain_results, tally

__all__ = ["ModeRun", "Options", "run"]

#: Three workers: one gets killed in scene 2, one stalled in scene 3, one is always left (so a
#: live worker's sweeper and a free pool process are there to recover the killed one's task).
WORKERS = 3


@dataclass(frozen=True)
class Options:
    broker_url: str | None = None
    store_url: str | None = None
    tasks: int = 6
    modes: tuple[str, ...] = ("plain", "leased")
    data_dir: Path | None = None
    json_path: Path | None = None


@dataclass
class ModeRun:
    mode: Mode
    edition: str
    history: History
    received: list[Received]
    tally: Tally


class Narrator:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.mode = ""

    def __call__(self, text: str) -> None:
        prefix = f"{time.monotonic() - self.started:5.1f}s {self.mode:>6} │ "
        print(prefix + text, flush=True)


def run(options: Options) -> int:
    if options.tasks < 3:
        raise DemoError("--tasks must be at least 3: one report per scene")
    data_dir = Path(options.data_dir or tempfile.mkdtemp(prefix="lease-celery-demo-"))
    data_dir = data_dir.resolve()
    for sub in ("broker", "broker-control", "results"):
        (data_dir / sub).mkdir(parents=True, exist_ok=True)
    broker_url = options.broker_url or "filesystem://"
    store_url = options.store_url or f"sqlite:///{data_dir / 'leases.sqlite3'}"
    _check_store(store_url)
    say = Narrator()
    receiver = start_receiver(data_dir / "outside-service.sqlite3",
                              data_dir / "outside-service.log")
    run_id = f"{time.strftime('%H%M%S')}-{secrets.token_hex(2)}"
    runs: list[ModeRun] = []
    workers: list[Worker] = []
    try:
        app, modes = _load_app(data_dir=data_dir, broker_url=broker_url, store_url=store_url,
                               reports_endpoint=f"{receiver.url}/reports")
        _header(say, data_dir, broker_url, store_url, receiver, app.conf)
        try:
            for name in options.modes:
                say.mode = name
                runs.append(_play(modes[name], run_id=run_id, options=options,
                                  data_dir=data_dir, broker_url=broker_url, store_url=store_url,
                                  receiver=receiver, conf=app.conf, say=say, workers=workers))
            say.mode = ""
            svg = data_dir / "timeline.svg"
            svg.write_text(picture.svg([(r.mode.title, _one_line(r.tally), r.history,
                                         r.received) for r in runs],
                                       ttl=float(app.conf.lease_ttl)))
            print()
            print(render([r.tally for r in runs]))
            for line in _lost_notes(runs, Broker(broker_url, app)):
                print(line)
            print(f"\ntimeline picture: {svg}\nevery event:      {data_dir}/*/timeline.jsonl")
        finally:
            _reap(workers)
            if not broker_url.startswith("filesystem"):
                _delete_queues(app, broker_url, [_queue(run_id, name) for name in options.modes])
    finally:
        receiver.stop()
    wall = time.monotonic() - say.started
    print(f"wall time:        {wall:.1f}s, from the first worker start to the last one's exit")
    if options.json_path is not None:
        summary = _summary(runs, data_dir=data_dir, svg=svg, broker_url=broker_url,
                           store_url=store_url, wall=wall, tasks=options.tasks)
        options.json_path.write_text(json.dumps(summary, indent=2))
    return 0


def _load_app(*, data_dir: Path, broker_url: str, store_url: str,
              reports_endpoint: str) -> tuple[Any, dict[str, Mode]]:
    """Import the app the way its workers will: configured from the environment."""
    # The settings module reads the environment when first imported: set it before that.
    os.environ.update({
        "EXAMPLE_DATA_DIR": str(data_dir), "EXAMPLE_BROKER_URL": broker_url,
        "EXAMPLE_STORE_URL": store_url, "EXAMPLE_REPORTS_ENDPOINT": reports_endpoint,
    })
    from .. import tasks
    from ..app import app

    return app, {
        "plain": Mode("plain", "plain celery.Task", tasks.publish_report_plain, leased=False),
        "leased": Mode("leased", "LeasedTask", tasks.publish_report, leased=True),
    }


def _play(mode: Mode, *, run_id: str, options: Options, data_dir: Path, broker_url: str,
          store_url: str, receiver: Receiver, conf: Any, say: Narrator,
          workers: list[Worker]) -> ModeRun:
    run_dir = data_dir / mode.name
    run_dir.mkdir(exist_ok=True)
    edition = f"{run_id}-{mode.name}"
    queue = _queue(run_id, mode.name)
    timeline_path = run_dir / "timeline.jsonl"
    timeline_path.unlink(missing_ok=True)  # a reused --data-dir: the previous run's events go
    env = {**os.environ, "EXAMPLE_QUEUE": queue, "EXAMPLE_TIMELINE": str(timeline_path)}
    if not mode.leased:
        # A plain Celery deployment has no sweeper. (The app defines both tasks, so without this
        # the plain run's workers, still shutting down while the leased run plays, would sweep
        # the leased run's leases and record it in the wrong timeline.)
        env["EXAMPLE_SWEEP_INTERVAL"] = "0"
    say(f"== {mode.title} ==")
    started = time.monotonic()
    mine = [start_worker(f"w{i}", domain=mode.name, queue=queue, env=env, log_dir=run_dir)
            for i in range(1, WORKERS + 1)]
    workers.extend(mine)
    stage = Stage(mode=mode, edition=edition, queue=queue, broker=Broker(broker_url, mode.task.app),
                  receiver_url=receiver.url, timeline_path=timeline_path, workers=mine,
                  ttl=float(conf.lease_ttl), sweep_interval=_sweep_interval(conf),
                  build_seconds=float(conf.report_build_seconds), say=say)
    try:
        hostnames = {w.hostname for w in mine}
        stage.wait(lambda h: hostnames <= {e.get("worker") for e in h.of("worker_ready")},
                   timeout=60, what="the workers to start")
        say(f"{WORKERS} workers ready in {time.monotonic() - started:.1f}s "
            f"(celery worker -P prefork -c 1 -O fair)")
        reports = list(range(1, options.tasks + 1))
        scenes.duplicates(stage, reports[:-2])
        scenes.lone_kill(stage, reports[-2])
        scenes.stall(stage, reports[-1])
    finally:
        # A warm shutdown takes the filesystem transport's worker ~5 s; let it happen while
        # the next mode plays (different queue, nothing in flight) instead of waiting for it.
        _shut_down(mine)
    history = stage.refresh()
    got = received(receiver.url, edition)
    results = (leased_results(store_url, edition, reports, history) if mode.leased
               else plain_results(str(conf.reports_db), edition))
    return ModeRun(mode, edition, history, got,
                   tally(mode=mode.name, title=mode.title, history=history,
                         report_ids=reports, received=got, results=results))


def _shut_down(workers: list[Worker]) -> None:
    for worker in workers:
        if worker.alive():
            os.killpg(worker.pid, signal.SIGCONT)  # a stopped process cannot shut down
            os.kill(worker.pid, signal.SIGTERM)    # the worker's warm shutdown


def _reap(workers: list[Worker], timeout: float = 15.0) -> None:
    """Wait for every worker to have exited; SIGKILL the ones that take too long."""
    _shut_down(workers)
    deadline = time.monotonic() + timeout
    for worker in workers:
        try:
            worker.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.kill()


def _queue(run_id: str, mode: str) -> str:
    """A queue of the run's own: on a shared broker, runs never take each other's messages."""
    return f"example-{run_id}-{mode}"


def _delete_queues(app: Any, broker_url: str, queues: list[str]) -> None:
    """Leave no demo queue behind on a shared broker (the filesystem one is in the data dir)."""
    try:
        with app.connection_for_write() as connection:
            channel = connection.default_channel
            redis = broker_url.startswith(("redis", "rediss"))
            for name in queues:  # Celery named each queue's exchange and routing key after it
                if redis:  # so this channel knows the binding, and the delete removes it too
                    channel.exchange_declare(exchange=name, type="direct", durable=True)
                    channel.queue_bind(name, exchange=name, routing_key=name)
                channel.queue_delete(name)
                if not redis:  # Redis keeps no exchange of its own
                    channel.exchange_delete(name)
        forgotten = Broker(broker_url, app).forget_unacked(queues)
        if forgotten:
            print(f"cleanup:          removed {forgotten} unacked message(s) the killed workers "
                  "left in Redis (a restore sweep would otherwise re-create the deleted queues "
                  "after visibility_timeout)")
    except Exception as exc:  # best effort: the story has been told already
        print(f"note: could not delete the demo's queues {queues}: {exc}", file=sys.stderr)


def _sweep_interval(conf: Any) -> float:
    """The leased workers' sweep interval: the setting, or lease_celery's default (ttl / 2)."""
    configured = conf.get("lease_sweep_interval")
    return float(configured) if configured is not None else float(conf.lease_ttl) / 2


def _killed_reports(history: History) -> dict[int, Execution | None]:
    """Each report a SIGKILL cut short -> the execution that completed it after all, or None."""
    killed = {x.report_id for x in history.executions if x.killed is not None}
    return {report_id: next((x for x in history.executions_of(report_id)
                             if x.killed is None and x.state == "SUCCESS"), None)
            for report_id in sorted(killed)}


def _lost_notes(runs: list[ModeRun], broker: Broker) -> list[str]:
    """What became of the deliveries the SIGKILL cut short, per mode, on this broker."""
    if broker.kind == "redis":
        why = (f"lost within the demo: Redis still held the killed worker's message unacked and "
               f"would restore it only after visibility_timeout ({broker.visibility_timeout:g}s) "
               "and a restore sweep")
    elif broker.kind == "filesystem":
        why = ("lost: the filesystem transport deleted the message when the killed worker "
               "fetched it; nothing will ever run it again")
    else:
        why = "lost within the demo: no delivery of it finished"
    how = {"sweeper": "the lease row recorded the task, and a sweeper re-published it once the "
                      "dead owner's lease expired",
           "broker": "the broker redelivered the message",
           "deferred": "a copy deferred while the dead owner's lease ran out took over"}
    notes = []
    for r in runs:
        for report_id, x in _killed_reports(r.history).items():
            if x is None:
                notes.append(f"killed delivery, {r.mode.title}: report {report_id} {why}")
            else:
                token = f" with token {x.token}" if x.token is not None else ""
                notes.append(f"killed delivery, {r.mode.title}: report {report_id} recovered"
                             f"{token}: {how.get(x.origin, 'another delivery ran it')}")
    return ["", *notes] if notes else []


def _one_line(t: Tally) -> str:
    return (f"{t.tasks} reports · {t.deliveries} deliveries · {t.body_executions} body executions"
            f" · {t.accepted_results} accepted results · {t.duplicate_effects} duplicate outside "
            f"effects · stale writes: {t.stale_accepted} accepted, {t.stale_refused} refused · "
            f"{t.lost} lost")


def _check_store(url: str) -> None:
    try:
        with open_store(url) as store:
            store.get("lease-celery-demo:probe")
    except (LeaseError, ValueError) as exc:
        raise DemoError(f"the lease store {url!r} is not usable: {exc}") from exc


def _header(say: Narrator, data_dir: Path, broker_url: str, store_url: str,
            receiver: Receiver, conf: Any) -> None:
    where = (f"kombu's filesystem transport, folders under {data_dir}/broker"
             if broker_url.startswith("filesystem") else broker_url)
    say("lease_celery demo: one failure story, played on real Celery workers, once per task "
        "type")
    say(f"  broker          {where}")
    say(f"  lease store     {store_url}  (ttl {conf.lease_ttl:g}s, heartbeat every "
        f"{conf.lease_heartbeat_interval:g}s; LeasedTask workers sweep for expired leases every "
        f"{_sweep_interval(conf):g}s; the publish goes through self.effect, a receipt under "
        "publish:report:<edition>:<id>:v1)")
    say(f"  outside service {receiver.url} (pid {receiver.process.pid}), records every request "
        f"in {data_dir}/outside-service.sqlite3")
    say(f"  data            {data_dir}")


def _summary(runs: list[ModeRun], *, data_dir: Path, svg: Path, broker_url: str,
             store_url: str, wall: float, tasks: int) -> dict[str, Any]:
    return {
        "broker_url": broker_url, "store_url": store_url, "tasks": tasks,
        "wall_seconds": round(wall, 2), "data_dir": str(data_dir), "timeline": str(svg),
        "modes": {r.mode.name: r.tally.as_dict() for r in runs},
        "max_token": {r.mode.name: max((s.token for s in r.history.leases), default=0)
                      for r in runs},
        # report id -> how a delivery cut short by the SIGKILL got done after all (or null)
        "killed": {r.mode.name: {str(report_id): None if x is None else
                                 {"origin": x.origin, "token": x.token, "worker": x.worker}
                                 for report_id, x in _killed_reports(r.history).items()}
                   for r in runs},
    }


def main_entry(options: Options) -> int:
    try:
        return run(options)
    except DemoError as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
