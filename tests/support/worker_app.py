"""The Celery app that the worker tests run in real ``celery worker`` processes.

Configured from the environment (set by tests/support/workers.py): broker and result backend on a
Redis database of the test run's own (tests/workers/test_rabbitmq.py: RabbitMQ and ``rpc://``, the
journal staying on Redis), the lease store URL, the queue, and a journal (a Redis list) where
task bodies and lease signals record what really happened, as seen by the worker.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import redis
from celery import Celery, signals

import lease_celery
from lease_celery import LeasedTask, LeaseLost
from tests.support.tokens import token_base

BROKER = os.environ.get("LEASE_TEST_BROKER", "redis://127.0.0.1:6379/11")
JOURNAL = os.environ.get("LEASE_TEST_JOURNAL", "journal")
#: The Redis the journal lives in: the broker itself, unless the broker is not Redis.
JOURNAL_REDIS = os.environ.get("LEASE_TEST_JOURNAL_REDIS", BROKER)

app = Celery("worker_app", broker=BROKER, backend=BROKER)
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_default_queue=os.environ.get("LEASE_TEST_QUEUE", "lease-tests"),
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("LEASE_TEST_VISIBILITY", "3600")),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    result_expires=600,
    lease_store_url=os.environ.get("LEASE_TEST_STORE", "sqlite:///lease_celery.sqlite3"),
    lease_ttl=float(os.environ.get("LEASE_TEST_TTL", "2")),
    lease_heartbeat_interval=float(os.environ.get("LEASE_TEST_HEARTBEAT", "0.5")),
    worker_hijack_root_logger=False,
)

_redis: redis.Redis | None = None


def _journal() -> redis.Redis:
    """The journal's client. Its timeout is explicit and long: under a green pool a body
    that busy-loops holds every reply for seconds, and a journal write must outwait it (one
    that timed out mid-way failed the body, under eventlet)."""
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(JOURNAL_REDIS, socket_timeout=60,
                                      socket_connect_timeout=60)
    return _redis


def record(event: str, **fields: Any) -> None:
    """Append one event to the journal list (the test reads it back in order)."""
    entry = {"event": event, "pid": os.getpid(), "host": socket.gethostname(),
             "t": time.time(), **fields}
    _journal().rpush(JOURNAL, json.dumps(entry, default=str))


def first_generation(task: LeasedTask) -> bool:
    """Is this the key's first claim? Its token is then the store's base + 1 (1 on the SQL
    stores, the epoch's floor + 1 on Redis: tests/support/tokens.py)."""
    return task.lease.token == token_base(task.lease_store) + 1


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}")
def work(self: LeasedTask, job_id: str, seconds: float = 0.0,
         check_every: float = 0.1) -> dict[str, Any]:
    """Run for ``seconds``, checking the lease; record start, loss and end in the journal."""
    return _checked_run(self, job_id, seconds, check_every)


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}", lease_extend_visibility=True)
def work_extended(self: LeasedTask, job_id: str, seconds: float = 0.0) -> dict[str, Any]:
    """``work`` with ``lease_extend_visibility`` on this task alone."""
    return _checked_run(self, job_id, seconds)


def _checked_run(task: LeasedTask, job_id: str, seconds: float,
                 check_every: float = 0.1) -> dict[str, Any]:
    """The body of ``work``: journal the start, check the lease every ``check_every`` s for
    ``seconds``, journal a loss (and re-raise it) or the end."""
    lease = task.lease
    record("body_start", job_id=job_id, token=lease.token, owner=lease.owner,
           task_id=task.request.id)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            time.sleep(check_every)
            lease.check()
    except LeaseLost as exc:
        record("body_lease_lost", job_id=job_id, token=lease.token, reason=str(exc))
        raise
    record("body_end", job_id=job_id, token=lease.token)
    return {"job_id": job_id, "token": lease.token, "owner": lease.owner}


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}")
def unchecked(self: LeasedTask, job_id: str, seconds: float = 0.0) -> dict[str, Any]:
    """Sleep without checking the lease: a worker that stalls finishes late and is fenced."""
    record("body_start", job_id=job_id, token=self.lease.token, owner=self.lease.owner,
           task_id=self.request.id)
    time.sleep(seconds)
    record("body_end", job_id=job_id, token=self.lease.token)
    return {"job_id": job_id, "token": self.lease.token, "pid": os.getpid()}


@app.task
def callback(result: Any, tag: str) -> None:
    """A ``link`` callback: records that it ran and with which result."""
    record("callback", tag=tag, result=result)


@signals.worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    record("worker_ready", hostname=sender.hostname if sender is not None else None)


def _journal_signal(name: str) -> None:
    def receiver(sender: Any = None, key: str | None = None, **fields: Any) -> None:
        lease = fields.pop("lease", None)
        fields.pop("signal", None)
        fields.pop("record", None)
        record(name, key=key, token=getattr(lease, "token", None), **fields)

    # One receiver per signal however often this module is imported (a worker imports it as
    # its app and again through its tasks' modules).
    getattr(lease_celery.signals, name).connect(receiver, weak=False,
                                                dispatch_uid=f"tests.journal.{name}")


for _name in ("lease_acquired", "lease_lost", "duplicate_deferred", "duplicate_ignored",
              "stale_result_rejected", "lease_released", "lease_dead"):
    _journal_signal(_name)


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}", max_retries=3)
def flaky(self: LeasedTask, job_id: str, failures: int) -> dict[str, Any]:
    """Fail ``failures`` times through Celery's own ``self.retry()``, then succeed."""
    record("body_start", job_id=job_id, token=self.lease.token, retries=self.request.retries)
    if self.request.retries < failures:
        raise self.retry(countdown=0.2, exc=RuntimeError(f"attempt {self.request.retries}"))
    return {"job_id": job_id, "token": self.lease.token, "retries": self.request.retries}


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}")
def not_json(self: LeasedTask, job_id: str) -> object:
    """Return a value the lease store refuses (not JSON)."""
    return {1, 2, 3}


def _explode(**_: Any) -> None:
    raise RuntimeError("a faulty receiver")


if os.environ.get("LEASE_TEST_FAULTY_RECEIVERS"):
    for _name in ("lease_acquired", "lease_renewed", "lease_released"):
        getattr(lease_celery.signals, _name).connect(_explode, weak=False)


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}")
def fenced_write(self: LeasedTask, job_id: str, seconds: float) -> dict[str, Any]:
    """Sleep (unchecked), then write a business row in the lease's own transaction."""
    import sqlite3

    token = self.lease.token
    record("body_start", job_id=job_id, token=token, task_id=self.request.id)
    time.sleep(seconds)
    try:
        with self.lease.fenced() as conn:
            if isinstance(conn, sqlite3.Connection):
                conn.execute("CREATE TABLE IF NOT EXISTS biz_writes (job_id TEXT, token INT)")
                conn.execute("INSERT INTO biz_writes VALUES (?, ?)", (job_id, token))
            else:
                table = f'"{self.lease_store.schema}".biz_writes'
                conn.execute(f"CREATE TABLE IF NOT EXISTS {table} (job_id text, token int)")
                conn.execute(f"INSERT INTO {table} VALUES (%s, %s)", (job_id, token))
    except LeaseLost as exc:
        record("fenced_refused", job_id=job_id, token=token, reason=str(exc))
        raise
    record("fenced_committed", job_id=job_id, token=token)
    return {"job_id": job_id, "token": token}


# -- effects on an outside target (tests/workers/test_worker_effects.py) ---------------------------


def _target_send(target: str, idempotency_key: str, payload: dict[str, Any],
                 token: int) -> dict[str, Any]:
    """The outside target: a table in a SQLite file of its own that records every request it
    receives, with the idempotency key it was sent. It does not deduplicate: one call, one row."""
    import sqlite3

    conn = sqlite3.connect(target, timeout=10)
    try:
        with conn:
            conn.execute("CREATE TABLE IF NOT EXISTS received (id INTEGER PRIMARY KEY, "
                         "idempotency_key TEXT NOT NULL, payload TEXT NOT NULL, "
                         "token INTEGER NOT NULL, pid INTEGER NOT NULL)")
            cursor = conn.execute(
                "INSERT INTO received (idempotency_key, payload, token, pid) VALUES (?, ?, ?, ?)",
                (idempotency_key, json.dumps(payload, sort_keys=True), token, os.getpid()))
        return {"receipt_id": cursor.lastrowid, "idempotency_key": idempotency_key,
                "sent_by_token": token}
    finally:
        conn.close()


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}")
def publish_then_stall(self: LeasedTask, job_id: str, target: str,
                       stall: float) -> dict[str, Any]:
    """Publish report ``job_id`` through ``self.effect`` (key ``publish:{job_id}:v1``) and
    journal what the call returned; the first generation then stalls ``stall`` seconds before
    returning (the test SIGKILLs its worker meanwhile: the effect's response is lost)."""
    token = self.lease.token
    payload = {"job_id": job_id, "version": 1}
    record("body_start", job_id=job_id, token=token, owner=self.lease.owner,
           task_id=self.request.id)

    def send(idempotency_key: str) -> dict[str, Any]:
        record("effect_fn_called", job_id=job_id, token=token, idempotency_key=idempotency_key)
        return _target_send(target, idempotency_key, payload, token)

    sent = self.effect(f"publish:{job_id}:v1", payload, send)
    record("effect_returned", job_id=job_id, token=token, result=sent)
    if first_generation(self):
        time.sleep(stall)
    return {"job_id": job_id, "token": token, "sent": sent}


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}")
def publish_then_die(self: LeasedTask, job_id: str, target: str) -> dict[str, Any]:
    """Publish report ``job_id`` through ``self.effect``; in the first generation the pool
    process dies (``os._exit``) inside ``fn`` right after the target recorded the request: the
    action happened, and its receipt was never marked done. A later generation journals the
    EffectOutcomeUnknown it gets (and fails with it) or what the call returned."""
    from lease_celery import EffectOutcomeUnknown

    token = self.lease.token
    payload = {"job_id": job_id, "version": 1}
    record("body_start", job_id=job_id, token=token, owner=self.lease.owner,
           task_id=self.request.id)

    def send(idempotency_key: str) -> dict[str, Any]:
        record("effect_fn_called", job_id=job_id, token=token, idempotency_key=idempotency_key)
        sent = _target_send(target, idempotency_key, payload, token)
        if first_generation(self):
            os._exit(1)
        return sent

    try:
        sent = self.effect(f"publish:{job_id}:v1", payload, send)
    except EffectOutcomeUnknown as exc:
        record("effect_outcome_unknown", job_id=job_id, token=token, reason=str(exc))
        raise
    record("effect_returned", job_id=job_id, token=token, result=sent)
    return {"job_id": job_id, "token": token, "sent": sent}


# -- failure policy, sweeper, shutdown and metrics (tests/workers/test_worker_policy.py,
# test_cli.py, test_metrics.py) --------------------------------------------------------------------


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}", permanent_errors=(ValueError,))
def always_fails(self: LeasedTask, job_id: str, kind: str = "transient") -> None:
    """Fail every time: ``transient`` raises RuntimeError, ``permanent`` ValueError (declared
    permanent on the task). Journals each body start with its token and lease attempt."""
    record("body_start", job_id=job_id, token=self.lease.token,
           attempts=self.lease.attempts, retries=self.request.retries,
           task_id=self.request.id)
    raise (ValueError if kind == "permanent" else RuntimeError)(f"{kind} failure of {job_id}")


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}", autoretry_for=(RuntimeError,),
          retry_kwargs={"max_retries": 2, "countdown": 0.2}, retry_backoff=False)
def autoretried(self: LeasedTask, job_id: str) -> None:
    """Always raise RuntimeError, retried by Celery's own ``autoretry_for`` (max_retries=2)."""
    record("body_start", job_id=job_id, token=self.lease.token,
           attempts=self.lease.attempts, retries=self.request.retries)
    raise RuntimeError(f"autoretried failure of {job_id}")


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}")
def kills_its_worker(self: LeasedTask, job_id: str) -> None:
    """SIGKILL this whole worker (its process group: the main process and every pool child)
    as soon as the body starts, in every generation."""
    import signal as _signal

    record("body_start", job_id=job_id, token=self.lease.token,
           takeovers=self.lease.takeovers, task_id=self.request.id)
    os.killpg(os.getpgrp(), _signal.SIGKILL)


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}", permanent_errors=(ValueError,))
def toggled(self: LeasedTask, job_id: str) -> dict[str, Any]:
    """Fail permanently while the Redis key ``<journal>:fail:<job_id>`` exists, else succeed."""
    record("body_start", job_id=job_id, token=self.lease.token, task_id=self.request.id)
    if _journal().exists(f"{JOURNAL}:fail:{job_id}"):
        raise ValueError(f"{job_id} is switched to fail")
    record("body_end", job_id=job_id, token=self.lease.token)
    return {"job_id": job_id, "token": self.lease.token}


def _journal_retry(sender: Any = None, key: str | None = None, **fields: Any) -> None:
    """lease_retry: journal the countdown and the backoff the row now carries (not_before)."""
    row = sender.lease_store.get(key) if sender is not None and key else None
    record("lease_retry", key=key, token=getattr(fields.get("lease"), "token", None),
           countdown=fields.get("countdown"), reason=fields.get("reason"),
           not_before=getattr(row, "not_before", None))


lease_celery.signals.lease_retry.connect(_journal_retry, weak=False)
for _name in ("lease_dead", "lease_swept", "lease_taken_over"):
    _journal_signal(_name)


def _float_env(name: str) -> float | None:
    value = os.environ.get(name)
    return None if value is None else float(value)


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    return None if value is None else int(value)


app.conf.update({name: value for name, value in {
    "lease_retry_errors": os.environ.get("LEASE_TEST_RETRY_ERRORS") == "1" or None,
    "lease_max_attempts": _int_env("LEASE_TEST_MAX_ATTEMPTS"),
    "lease_max_takeovers": _int_env("LEASE_TEST_MAX_TAKEOVERS"),
    "lease_backoff_base": _float_env("LEASE_TEST_BACKOFF_BASE"),
    "lease_backoff_max": _float_env("LEASE_TEST_BACKOFF_MAX"),
    "lease_sweep_interval": _float_env("LEASE_TEST_SWEEP_INTERVAL"),
    "lease_sweep_grace": _float_env("LEASE_TEST_SWEEP_GRACE"),
    "lease_metrics_port": _int_env("LEASE_TEST_METRICS_PORT"),
    "worker_soft_shutdown_timeout": _float_env("LEASE_TEST_SOFT_SHUTDOWN"),
    "broker_heartbeat": _float_env("LEASE_TEST_BROKER_HEARTBEAT"),
    "task_default_priority": _int_env("LEASE_TEST_DEFAULT_PRIORITY"),
    "task_queue_max_priority": _int_env("LEASE_TEST_QUEUE_MAX_PRIORITY"),
    "lease_recovery_priority": os.environ.get("LEASE_TEST_RECOVERY_PRIORITY"),  # as text
    "lease_extend_visibility": os.environ.get("LEASE_TEST_EXTEND_VISIBILITY") == "1" or None,
}.items() if value is not None})


# -- settle (tests/workers/test_settle_workers.py) -------------------------------------------------
# Tasks for the seams between the lease row and Celery's own lifecycle (DESIGN.md §6), and
# Celery's task signals journaled per task id (what the result backend and the callbacks saw).


def _open_store_connections(store: Any, count: int = 4) -> None:
    """Have ``count`` threads use the store at the same instant (its pool grows to match)."""
    import threading

    barrier = threading.Barrier(count)

    def use() -> None:
        barrier.wait(5)
        for _ in range(3):
            store.now()

    threads = [threading.Thread(target=use) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}")
def settle_until_lost(self: LeasedTask, job_id: str, first_for: float = 20.0) -> dict[str, Any]:
    """The first generation runs (checking the lease every 0.1 s) for up to ``first_for``
    seconds, i.e. until ``check()`` raises LeaseLost; later generations return at once.

    The first generation first opens a few store connections at once, so that while the test
    slows the store's replies down the heartbeat and the body each find a connection already
    open (a new one would cost several slow round trips to set up, and change the timing under
    test)."""
    first = first_generation(self)
    if first:
        _open_store_connections(self.lease_store)
    return _checked_run(self, job_id, first_for if first else 0.0)


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}")
def settle_quick(self: LeasedTask, job_id: str) -> dict[str, Any]:
    """Return at once; with ``LEASE_TEST_SETTLE_HOLD`` set, the lease_finished receiver below
    holds this task between its accepted finish and Celery's result write."""
    record("body_start", job_id=job_id, token=self.lease.token, owner=self.lease.owner,
           task_id=self.request.id)
    return {"job_id": job_id, "token": self.lease.token, "owner": self.lease.owner}


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}", soft_time_limit=1)
def settle_soft_limited(self: LeasedTask, job_id: str, seconds: float = 3.0) -> None:
    """Sleep past the task's soft time limit (1 s)."""
    record("body_start", job_id=job_id, token=self.lease.token, task_id=self.request.id)
    time.sleep(seconds)
    record("body_end", job_id=job_id, token=self.lease.token)


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}", time_limit=1)
def settle_hard_limited(self: LeasedTask, job_id: str, seconds: float = 3.0) -> None:
    """Sleep past the task's hard time limit (1 s): the pool kills the process running it."""
    record("body_start", job_id=job_id, token=self.lease.token, task_id=self.request.id)
    time.sleep(seconds)
    record("body_end", job_id=job_id, token=self.lease.token)


_SETTLE_HOLD = _float_env("LEASE_TEST_SETTLE_HOLD")


def _hold_after_finish(sender: Any = None, key: str | None = None, **_: Any) -> None:
    """lease_finished of settle_quick: journal, then sleep ``LEASE_TEST_SETTLE_HOLD`` seconds
    (the accepted result is in the lease row, not yet in the result backend)."""
    if _SETTLE_HOLD and getattr(sender, "name", None) == settle_quick.name:
        record("settle_hold", key=key, task_id=sender.request.id, seconds=_SETTLE_HOLD)
        time.sleep(_SETTLE_HOLD)
        record("settle_hold_over", key=key, task_id=sender.request.id)


lease_celery.signals.lease_finished.connect(_hold_after_finish, weak=False)


@signals.task_success.connect
def _journal_task_success(sender: Any = None, result: Any = None, **_: Any) -> None:
    record("task_success", task=getattr(sender, "name", None),
           task_id=getattr(getattr(sender, "request", None), "id", None), result=result)


@signals.task_failure.connect
def _journal_task_failure(sender: Any = None, task_id: str | None = None,
                          exception: BaseException | None = None, **_: Any) -> None:
    record("task_failure", task=getattr(sender, "name", None), task_id=task_id,
           exception=repr(exception))


@signals.task_prerun.connect
def _journal_task_prerun(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    # Sent right before LeasedTask.__call__: the delivery is at the lease gate.
    record("task_prerun", task=getattr(sender, "name", None), task_id=task_id)


@signals.task_postrun.connect
def _journal_task_postrun(sender: Any = None, task_id: str | None = None,
                          state: str | None = None, **_: Any) -> None:
    record("task_postrun", task=getattr(sender, "name", None), task_id=task_id, state=state)



@signals.task_received.connect
def _journal_task_received(sender: Any = None, request: Any = None, **_: Any) -> None:
    record("task_received", task=getattr(request, "name", None),
           task_id=getattr(request, "id", None))


if os.environ.get("LEASE_TEST_RESULT_BACKEND"):
    app.conf.result_backend = os.environ["LEASE_TEST_RESULT_BACKEND"]
if BROKER.startswith("sqs://"):  # moto's SQS server (tests/support/sqs.py)
    from tests.support.sqs import transport_options

    app.conf.broker_transport_options = transport_options(
        float(os.environ.get("LEASE_TEST_VISIBILITY", "3600")))


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}", soft_time_limit=1,
          lease_retry_time_limits=True)
def soft_limited_retried(self: LeasedTask, job_id: str) -> dict[str, Any]:
    """Opted into retrying time limits: the first generation sleeps past the soft limit (1 s),
    later ones return at once."""
    token = self.lease.token
    record("body_start", job_id=job_id, token=token, task_id=self.request.id)
    if first_generation(self):
        time.sleep(3.0)
    return {"job_id": job_id, "token": token}


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}", time_limit=1,
          lease_retry_time_limits=True)
def hard_limited_retried(self: LeasedTask, job_id: str) -> dict[str, Any]:
    """Opted into retrying time limits: the first generation sleeps past the hard limit (1 s:
    the pool kills it), later ones return at once."""
    token = self.lease.token
    record("body_start", job_id=job_id, token=token, task_id=self.request.id)
    if first_generation(self):
        time.sleep(3.0)
    return {"job_id": job_id, "token": token}


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}", ignore_result=True,
          lease_finish_in_background=True)
def quiet(self: LeasedTask, job_id: str) -> None:
    """Fire and forget: Celery stores nothing and sends nothing, so the finish is written
    behind the return (lease_celery.execution.background)."""
    record("body_start", job_id=job_id, token=self.lease.token, owner=self.lease.owner)


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}", lease_unique=True)
def unique_work(self: LeasedTask, job_id: str, seconds: float = 0.0) -> dict[str, Any]:
    """``work`` with ``lease_unique``: a publish of a held or done key returns its holder."""
    return _checked_run(self, job_id, seconds)


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}")
def stepper(self: LeasedTask, job_id: str, steps: int, pause: float) -> dict[str, Any]:
    """Long work in ``steps`` steps, resumed from the key's checkpoint: journal each step run
    (with this execution's token), then checkpoint it."""
    lease = self.lease
    done = int((lease.checkpoint_data or {}).get("done", 0))
    record("body_start", job_id=job_id, token=lease.token, resumed_after=done)
    for step in range(done + 1, steps + 1):
        time.sleep(pause)
        lease.check()
        record("step", job_id=job_id, step=step, token=lease.token)
        lease.checkpoint({"done": step})
    return {"job_id": job_id, "token": lease.token, "steps": steps}


def _limited_run(task: LeasedTask, job_id: str, group: str, seconds: float) -> dict[str, Any]:
    """A limited body: journal its start and end on the store's clock, with its token and
    slot, sleeping ``seconds`` unchecked (a holder stopped past its ttl finishes late, and its
    finish is refused)."""
    lease = task.lease
    slot = task.request.lease.lease.slot  # the execution's lease
    record("limited_start", job_id=job_id, group=group, token=lease.token, slot=slot,
           task_id=task.request.id, at=task.lease_store.now())
    time.sleep(seconds)
    record("limited_end", job_id=job_id, group=group, token=lease.token, slot=slot,
           at=task.lease_store.now())
    return {"job_id": job_id, "token": lease.token, "slot": slot}


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}", lease_limit=2,
          lease_limit_key="group:{group}", ignore_result=True)
def limited(self: LeasedTask, job_id: str, group: str, seconds: float = 1.0) -> dict[str, Any]:
    """At most two of a group at once (``lease_limit = 2``, the group an argument)."""
    return _limited_run(self, job_id, group, seconds)


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}", lease_limit=1,
          lease_limit_key="one:{group}", ignore_result=True)
def limited_one(self: LeasedTask, job_id: str, group: str,
                seconds: float = 1.0) -> dict[str, Any]:
    """One of a group at a time (``lease_limit = 1``)."""
    return _limited_run(self, job_id, group, seconds)


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}", lease_rate_limit="4/s",
          ignore_result=True)
def rated(self: LeasedTask, job_id: str, group: str = "rated") -> dict[str, Any]:
    """At most 4 starts per second across every worker (the group: the task's name)."""
    return _limited_run(self, job_id, group, 0.0)


for _name in ("limit_wait", "limit_handed_on"):
    _journal_signal(_name)




# -- the app's own database (tests/workers/test_app_transactions.py) ---------------------------

@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}")
def app_write(self: LeasedTask, job_id: str, mode: str, die: bool = True) -> dict[str, Any]:
    """Insert one app row for the job, then (in the first generation, with ``die``) kill this
    pool process before the task returns. ``mode`` ``fenced``: the row commits in
    ``self.lease.fenced()`` and the finish is written after the body; ``transaction``: the row
    and the finish commit together (``self.lease.transaction``); ``commit_reply_lost``: as
    ``transaction``, and the first generation's commit lands but its reply is lost."""
    from tests.support import app_db

    token = self.lease.token
    record("body_start", job_id=job_id, token=token, task_id=self.request.id)
    conn = app_db.connect(self.lease_store, "driver")
    outcome = {"job_id": job_id, "token": token}
    if mode == "fenced":
        with self.lease.fenced() as fenced:
            app_db.insert(fenced, self.lease_store, job_id, token)
    elif mode == "commit_reply_lost":
        # The commit lands and its reply is lost (first generation): the outcome is decided.
        lost = app_db.CommitReplyLost(conn) if first_generation(self) else conn
        with self.lease.transaction(lost) as tx:
            app_db.insert(conn, self.lease_store, job_id, token)
            tx.complete(outcome)
    else:
        with self.lease.transaction(conn) as tx:
            app_db.insert(conn, self.lease_store, job_id, token)
            tx.complete(outcome)
    record("app_row_committed", job_id=job_id, token=token)
    if die and first_generation(self):
        os._exit(1)  # between the commit and the return: the worker's death is the task's
    conn.close()
    return outcome


# The tasks of tests/workers/test_celery_semantics.py live in a module of their own, registered
# on this app when the worker imports it.
from tests.support import semantics_tasks  # noqa: E402, F401
