"""``celery leases doctor``: read the app's configuration and explain it in terms of the three
promises (delivery, ownership, effects).

Each finding has a severity: ``error`` (the lease guarantees do not hold: doctor exits
non-zero), ``warning`` (they hold, at a cost worth knowing) or ``ok``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from .apps import is_leased
from .errors import LeaseError
from .execution.recovery import (
    broker_family,
    queue_max_priority,
    queue_of,
    recovery_priority,
    redis_list,
)
from .models import Finding
from .names import FIXES, name_problems
from .settings import (
    LeaseSettings,
    check_app_settings,
    recovery_priority_setting,
    resolve_settings,
    sweep_grace,
    sweep_interval,
)
from .slots import schedule_problems
from .stores.registry import open_store
from .stores.urls import redact
from .worker.sweeper import QUEUE_WAIT_GRACES
from .worker.visibility import extension_tick, visibility_timeout

__all__ = ["Finding", "diagnose", "leased_tasks"]

#: RabbitMQ's server default consumer_timeout (30 minutes).
RABBITMQ_CONSUMER_TIMEOUT = 1800.0
_AMQP = ("amqp", "amqps", "pyamqp", "librabbitmq")
#: Tasks longer than this are "long" for prefetching purposes.
LONG_TASK = 60.0


def diagnose(app: Any, *, store_url: str | None = None,
             import_error: BaseException | None = None) -> list[Finding]:
    """Every finding about ``app``'s configuration, errors first; never raises on what it
    diagnoses. ``store_url``: judge that store instead of the ones the settings name.
    ``import_error``: the app module did not import (the one finding then)."""
    if import_error is not None:
        why = (str(import_error) if isinstance(import_error, LeaseError)
               else _one_line(import_error))
        return [Finding("app.import", "error", "ownership",
                        f"the app does not import: {why} (fix the module, then run doctor "
                        "again)")]
    try:
        app.conf.get("lease_store_url")  # Celery loads the configuration on the first read
    except Exception as exc:
        return [Finding("app.config", "error", "ownership",
                        f"the app's configuration does not load: {_one_line(exc)} (fix what "
                        "config_from_object names, then run doctor again)")]
    findings = import_task_modules(app)
    tasks, made = leased_tasks(app)
    findings += made
    findings += [Finding(p.code, "error", "ownership", p.message)
                 for p in name_problems(app, tasks)]
    settings_by_task: dict[str, LeaseSettings] = {}
    for task in tasks:
        try:
            settings_by_task[task.name] = task.lease_settings
        except LeaseError as exc:
            findings.append(_invalid(exc))
    if not tasks:
        # A task refused while it was made (``made``) is a LeasedTask doctor could not make:
        # its error says so; "no task is leased" would be false.
        if not made:
            findings.append(Finding("tasks.none", "warning", "ownership",
                                    "no task uses base=LeasedTask: nothing here is leased"))
        try:
            settings_by_task[""] = resolve_settings(app)
        except LeaseError as exc:
            findings.append(_invalid(exc))
    findings += [_invalid(exc) for exc in check_app_settings(app)]
    longest = _longest_task(app, tasks)
    shortest_ttl = min((s.ttl for s in settings_by_task.values()), default=None)
    stores = ([store_url] if store_url else
              sorted({s.store_url for s in settings_by_task.values()}))
    checks: list[Callable[[], list[Finding]]] = [
        partial(_delivery, app, tasks, longest, shortest_ttl),
        partial(_ownership, app, settings_by_task, stores, list(findings)),
        partial(_worker_pool, app),
        partial(_record_at_publish, app, settings_by_task)]
    for check in checks:
        try:
            findings += check()
        except Exception as exc:  # a check that cannot run is itself a finding, never a crash
            findings.append(Finding("doctor.check_failed", "error", "ownership",
                                    f"a check could not run: {_one_line(exc)}"))
    order = {"error": 0, "warning": 1, "ok": 2}
    unique = list(dict.fromkeys(findings))  # a task refused at bind is met again when read
    return sorted(unique, key=lambda f: order[f.severity])


def import_task_modules(app: Any) -> list[Finding]:
    """Import the modules the app names for its tasks (``imports``, ``include``, and what
    ``autodiscover_tasks`` registered), as a worker does at start, so doctor judges the tasks
    defined there; each module that does not import is a finding."""
    findings: list[Finding] = []
    from celery import signals as celery_signals

    try:  # autodiscover_tasks hooks itself to this signal
        for _, response in celery_signals.import_modules.send(sender=app):
            if isinstance(response, Exception):
                findings.append(Finding("app.import", "error", "ownership",
                                        f"the app's task modules do not import: "
                                        f"{_one_line(response)}"))
        modules = list(app.loader.default_modules)
    except Exception as exc:
        return [*findings, Finding("app.import", "error", "ownership",
                                   f"the app's task modules cannot be listed: {_one_line(exc)}")]
    for module in modules:
        try:
            app.loader.import_task_module(module)
        except Exception as exc:
            findings.append(Finding(
                "app.import", "error", "ownership",
                f"task module {module} (the app's imports/include) does not import: "
                f"{_one_line(exc)}; a worker would not start"))
    return findings


def leased_tasks(app: Any) -> tuple[list[Any], list[Finding]]:
    """The app's LeasedTasks, and a finding per task that could not be made or bound.

    Celery makes and binds every task in one loop when the app is finalized, and a task
    refused there (a bad ``lease_*`` value raises ``ConfigError``) stops the loop: the tasks
    after it are left unmade. Here each is made and bound on its own, so one bad task is a
    finding and the others are still judged."""
    from celery.utils.functional import maybe_evaluate

    findings: list[Finding] = []
    try:
        registry = app.tasks
    except Exception as exc:
        findings.append(_invalid(exc))
        pending = getattr(app, "_pending", None)
        while pending:  # what the aborted finalize left unmade
            try:
                maybe_evaluate(pending.popleft())
            except Exception as more:
                findings.append(_invalid(more))
        registry = app._tasks
        for task in list(registry.values()):
            try:
                task.bind(app)  # idempotent for the tasks bound before the failure
            except Exception as more:
                findings.append(_invalid(more))
    return [t for t in registry.values() if is_leased(t)], findings


def _invalid(exc: BaseException) -> Finding:
    """A refused setting or option (or any error met making the tasks) as a finding, with
    what the name takes."""
    message = _one_line(exc) if not isinstance(exc, LeaseError) else str(exc)
    name = re.search(r"\b(lease_[a-z_]+)", message)
    fix = FIXES.get(name.group(1)) if name else None
    return Finding("settings.invalid", "error", "ownership",
                   message + (f" (fix: set {name.group(1)} to {fix})" if name and fix else ""))


def _sweep_interval(app: Any) -> float | None:
    """``lease_sweep_interval``, or None when it is refused (a settings.invalid finding)."""
    try:
        return sweep_interval(app)
    except LeaseError:
        return None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _longest_task(app: Any, tasks: list[Any]) -> float | None:
    """The longest time limit of ``tasks``, or None when one has none. With no task made
    (none leased, or every one refused: an error already), the app's task_time_limit, the
    only limit known."""
    if not tasks:
        return float(app.conf.task_time_limit) if app.conf.task_time_limit else None
    limits = [t.time_limit or app.conf.task_time_limit for t in tasks]
    known = [float(x) for x in limits if x]
    return max(known) if len(known) == len(limits) and known else None


def _delivery(app: Any, tasks: list[Any], longest: float | None,
              ttl: float | None) -> list[Finding]:
    conf = app.conf
    found: list[Finding] = []
    scheme = urlsplit(conf.broker_url or "amqp://").scheme.split("+")[0]
    vt = visibility_timeout(app)
    if vt is not None:
        found += _visibility(scheme, vt, tasks, longest, ttl)
    elif scheme in _AMQP:
        found += _consumer_timeout(app, tasks)
    if vt is None and any(_extends_visibility(t) for t in tasks):
        found.append(Finding(
            "broker.visibility_extended", "warning", "delivery",
            f"lease_extend_visibility is on, but {scheme} has no visibility timeout to "
            "extend: it does nothing (only SQS and Redis hand a running task's message out "
            "again on a timer)"))
    acks_late = [t.name for t in tasks if not t.acks_late]
    if acks_late:
        found.append(Finding(
            "task.acks_late", "warning", "delivery",
            f"task_acks_late is off for {', '.join(sorted(acks_late))}: the broker forgets a "
            "message before the task runs, so a worker crash leaves only the lease sweeper to "
            "bring it back (set task_acks_late=True)"))
    reject = [t.name for t in tasks if t.acks_late and not t.reject_on_worker_lost]
    if reject:
        found.append(Finding(
            "task.reject_on_worker_lost", "error", "delivery",
            f"task_reject_on_worker_lost is off for {', '.join(sorted(reject))}: when a "
            "worker process dies, Celery records FAILURE (WorkerLostError) and runs the "
            "errbacks, while the lease sweeper brings the unfinished task back and it may then "
            "succeed: one task id would report both. Set task_reject_on_worker_lost=True"))
    multiplier = int(conf.worker_prefetch_multiplier or 0)
    if multiplier > 1 and (longest is None or longest > LONG_TASK):
        towards = ("the visibility timeout" if vt is not None
                   else "RabbitMQ's consumer_timeout" if scheme in _AMQP else None)
        found.append(Finding(
            "worker.prefetch_multiplier", "warning", "delivery",
            f"worker_prefetch_multiplier={multiplier}: each worker process reserves "
            f"{multiplier} messages while running a long task; they wait behind it"
            + (f" (and sit unacked towards {towards})" if towards else "")
            + ". Use 1 for long tasks"))
    if conf.worker_deduplicate_successful_tasks:
        found.append(Finding(
            "worker.deduplicate_successful_tasks", "warning", "delivery",
            "worker_deduplicate_successful_tasks only catches redeliveries of tasks that "
            "already succeeded, needs a persistent result backend and the transport's "
            "redelivered flag (SQS never sets it); the lease already drops those copies and "
            "also catches copies of running tasks. It is redundant here"))
    backend = str(conf.result_backend or "")
    if backend.partition("://")[0] == "rpc":
        found.append(Finding(
            "backend.rpc", "ok", "delivery",
            "result_backend=rpc:// sends a task's result to the reply queue of the thread that "
            "published it (its reply_to), and only that thread reads it: AsyncResult(id).get() "
            "anywhere else (another client, a worker, a restarted publisher) stays PENDING, "
            "and a result sent once that queue is gone is dropped. Redeliveries and lease "
            "re-publishes keep the reply_to, so the publisher gets the accepted result; "
            "lease_celery never asks the result backend whether a task finished: the lease "
            "row is the record (celery leases show KEY)"))
    found += _recovery_priority(app, tasks)
    if not any(f.severity != "ok" for f in found):
        found.append(Finding("delivery.ok", "ok", "delivery",
                             f"broker ({scheme}) settings agree with the leases"))
    return found


#: What recovered work is, in a finding.
_RECOVERED = ("re-published work (the task of an owner that died or stalled, a message the "
              "broker lost, a lease that lapsed under its delivery)")


#: SQS's ceiling on a message's visibility: 12 hours from its receipt, whatever is set.
SQS_MAX_VISIBILITY = 43200.0


def _visibility(scheme: str, vt: float, tasks: list[Any], longest: float | None,
                ttl: float | None) -> list[Finding]:
    """A broker that hands an unacked message out again after ``vt`` seconds (Redis, SQS)."""
    found: list[Finding] = []
    if tasks and all(_extends_visibility(t) for t in tasks):
        found.append(Finding(
            "broker.visibility_extended", "ok", "delivery",
            f"lease_extend_visibility: while a task's lease is renewed its worker extends its "
            f"message's visibility every {extension_tick(vt):g}s (a quarter of visibility_timeout"
            f"={vt:g}s), so {scheme} does not hand it out again while it runs; when the owner "
            "dies or stalls the extensions stop and the message comes back after the timeout"))
    elif longest is None:
        found.append(Finding(
            "broker.visibility_timeout.unknown", "warning", "delivery",
            f"{scheme} hands an unacked message out again after visibility_timeout={vt:g}s"
            ", even while a worker still runs it; these tasks have no time limit, so "
            "nothing says they finish sooner. Leases defer the extra copies, but set "
            "task_time_limit (or time_limit on the tasks) below the visibility timeout, or "
            "lease_extend_visibility=True"))
    elif vt < longest:
        found.append(Finding(
            "broker.visibility_timeout", "warning", "delivery",
            f"visibility_timeout={vt:g}s is shorter than the longest task "
            f"({longest:g}s): {scheme} delivers it again while it runs. The lease defers "
            "each copy, at the cost of a re-publish; raise the visibility timeout, or set "
            "lease_extend_visibility=True"))
    if ttl is not None and vt < ttl:
        found.append(Finding(
            "broker.visibility_timeout.ttl", "warning", "delivery",
            f"visibility_timeout={vt:g}s is shorter than lease_ttl={ttl:g}s: redelivery "
            "comes before a dead owner's lease can even expire"))
    if scheme == "sqs":
        found += _sqs_ceiling(vt, longest)
    return found


def _extends_visibility(task: Any) -> bool:
    try:
        return bool(task.lease_settings.extend_visibility)
    except LeaseError:  # a settings.invalid finding already
        return False


def _sqs_ceiling(vt: float, longest: float | None) -> list[Finding]:
    """SQS caps visibility at 12 h: a longer timeout is refused, a longer task redelivered."""
    if vt > SQS_MAX_VISIBILITY:
        return [Finding(
            "broker.visibility_timeout.sqs_ceiling", "error", "delivery",
            f"visibility_timeout={vt:g}s is above SQS's ceiling of 12 h ({SQS_MAX_VISIBILITY:g}"
            "s): SQS refuses to create the queue with it. Set it to 43200 at most")]
    if longest is not None and longest > SQS_MAX_VISIBILITY:
        return [Finding(
            "broker.visibility_timeout.sqs_ceiling", "warning", "delivery",
            f"the longest task ({longest:g}s) outlasts SQS's ceiling on visibility (12 h, "
            "counted from the message's receipt): SQS hands it to another worker while it "
            "runs, whatever visibility_timeout says. The lease defers each copy; split the "
            "work, or keep it under 12 h")]
    return []


def _recovery_priority(app: Any, tasks: list[Any]) -> list[Finding]:
    """Whether recovered work goes ahead of a queue's backlog (``execution.recovery``)."""
    try:
        setting = recovery_priority_setting(app)
        family = broker_family(app)
    except Exception:  # refused (a settings.invalid finding already), or a transport kombu
        return []  # cannot load (other findings say so)
    code = "delivery.recovery_priority"
    if not tasks:
        return []
    if setting is None:
        return [Finding(code, "ok", "delivery", f"lease_recovery_priority=False: {_RECOVERED}"
                        " keeps the priority it was published with and waits behind the "
                        "queue's backlog")]
    if family == "amqp":
        queues = [queue_of(app, {"task": t.name}) for t in tasks]
        flat = sorted({str(getattr(q, "name", "?")) for q in queues
                       if queue_max_priority(app, q) is None})
        if flat:
            return [Finding(code, "warning", "delivery",
                            f"{_RECOVERED} goes to the tail of queue {', '.join(flat)} behind "
                            "its whole backlog: RabbitMQ orders a queue by priority only when "
                            "it was declared with x-max-priority. Set task_queue_max_priority"
                            "=10; RabbitMQ keeps a queue's arguments from its first "
                            "declaration, so delete an existing queue (or use a new name) to "
                            "have it declared again")]
        late = sorted(t.name for t in tasks
                      if (t.priority or 0) >= (recovery_priority(
                          app, {"task": t.name}) or 0))
        if late:
            return [Finding(code, "warning", "delivery",
                            f"{', '.join(late)} are published at a priority as high as "
                            f"recovery's: {_RECOVERED} waits behind them. Publish new work "
                            "below task_queue_max_priority (or set lease_recovery_priority)")]
        return []  # ahead of new work: nothing to say
    if family == "redis":
        first = redis_list(app, recovery_priority(app, {}))
        late = sorted(t.name for t in tasks if redis_list(app, t.priority) <= first)
        if late:
            return [Finding(code, "warning", "delivery",
                            f"{_RECOVERED} of {', '.join(late)} waits behind the queue's whole "
                            f"backlog: kombu's Redis transport pops priority {first} first, "
                            "and new work without a priority goes there too. Set "
                            "task_default_priority=5 (a later one of the transport's "
                            "priority_steps) so that new work waits in a later list; a task "
                            "published by name (send_task) needs priority=5 too")]
        return []
    return [Finding(code, "ok", "delivery",
                    f"the {family or 'configured'} transport has no message priority: "
                    f"{_RECOVERED} waits behind the queue's backlog")]


def _ownership(app: Any, settings_by_task: dict[str, LeaseSettings], stores: list[str],
               earlier: list[Finding]) -> list[Finding]:
    found: list[Finding] = []
    for name, settings in sorted(settings_by_task.items()):
        who = f"task {name}" if name else "the app"
        if settings.heartbeat_interval > settings.ttl / 2:
            found.append(Finding(
                "lease.heartbeat_interval", "warning", "ownership",
                f"{who}: lease_heartbeat_interval={settings.heartbeat_interval:g}s is not well "
                f"below lease_ttl={settings.ttl:g}s; one late renewal loses the lease "
                "(use ttl/3 or less)"))
    for url in stores:
        found += _store(url)
    if _sweep_interval(app) == 0:
        found.append(Finding(
            "lease.sweeper_off", "warning", "ownership",
            "lease_sweep_interval=0 turns the workers' sweeper off: schedule the "
            "lease_celery.sweep task with beat, or recovery after a lost worker waits on the "
            "broker's redelivery"))
    found += _periodic(app)
    if not any(f.promise == "ownership" and f.severity != "ok" for f in found + earlier):
        found.append(Finding("ownership.ok", "ok", "ownership",
                             "lease settings and store are sound"))
    return found


_GREEN = (
    "tasks are greenlets of one process. lease_celery runs its heartbeat and sweeper on real "
    "OS threads there, with store connections of their own, so a body that computes without "
    "yielding (longer than the ttl) keeps its lease and its neighbours': the GIL switches to "
    "the heartbeat, which also renews a claim whose reply waits unread behind such a body. "
    "What such a body still stops is every other greenlet: other tasks' I/O and the broker "
    "connection. A C extension that holds the GIL longer than the ttl stops the heartbeat "
    "too. Lease signals from the heartbeat are delivered on the hub")
#: What holds for the leases on each of Celery's pools.
_POOLS = {
    "prefork": "each task runs in a pool process, whose own heartbeat thread renews its "
               "leases: a body that blocks or computes holds its lease; a process that is "
               "stopped (or dies) loses its leases after the ttl, and the sweeper re-publishes "
               "them",
    "threads": "one process runs the tasks on threads, and one heartbeat thread renews all its "
               "leases in batches. The GIL switches between threads, so a CPU-bound body does "
               "not stop renewals, but a C extension that holds the GIL longer than the ttl "
               "does, and a stopped process loses every lease at once",
    "solo": "the body runs in the worker's main thread and blocks its event loop while it "
            "runs (no other message, no broker heartbeat, no remote control); the heartbeat "
            "is a thread of its own, so the lease holds",
    "gevent": _GREEN,
    "eventlet": _GREEN + " (eventlet itself is deprecated upstream)",
}


def _record_at_publish(app: Any, settings_by_task: dict[str, LeaseSettings]) -> list[Finding]:
    """With ``lease_record_at_publish``: what the sweep grace trades (an ``ok`` note)."""
    recording = sorted(name for name, settings in settings_by_task.items()
                       if name and settings.record_at_publish)
    if not recording:
        return []
    grace = sweep_grace(app)
    return [Finding(
        "delivery.record_at_publish", "ok", "delivery",
        f"lease_record_at_publish is on for {', '.join(recording)}: a message the broker loses "
        f"before anyone claims it is re-published lease_sweep_grace={grace:g}s after it became "
        f"claimable. A message waiting behind a long queue is not lost: while its queue still "
        f"holds messages it is left alone, up to {QUEUE_WAIT_GRACES} graces "
        f"({QUEUE_WAIT_GRACES * grace:g}s). A grace shorter than a message's usual wait "
        "(prefetched ones included, which the broker no longer counts) re-publishes some that "
        "were only waiting (the lease drops the copies: a message each); a longer one delays "
        "the recovery of a lost one")]


def _worker_pool(app: Any) -> list[Finding]:
    """A note on what holds for the leases on the configured ``worker_pool``."""
    from celery.concurrency import ALIASES

    configured = str(app.conf.worker_pool or "prefork")
    path = ALIASES.get(configured, configured)
    name = next((alias for alias, where in ALIASES.items()
                 if where == path and alias in _POOLS), None)
    what = (_POOLS[name] if name is not None else
            "not a pool lease_celery knows: its heartbeat renews the leases of each process "
            "from a thread, which must be able to run while the bodies do")
    return [Finding("worker.pool", "ok", "ownership",
                    f"worker_pool={configured} (a worker's -P overrides it): {what}")]


def _periodic(app: Any) -> list[Finding]:
    """beat_schedule entries whose LeasedTask would not run once per slot under
    lease_celery.beat: a lease_key equal in every slot (it runs once, ever), a fixed task_id
    as the key, a schedule with no slot rule."""
    return [Finding(code, "warning", "ownership", message)
            for code, message in schedule_problems(app)]


def _store(url: str) -> list[Finding]:
    """What the store at ``url`` says about itself (``Store.diagnose``), or why it cannot be
    used."""
    try:
        with open_store(url) as store:
            return store.diagnose()
    except ImportError as exc:  # the URL is fine: the store's extra is not installed
        return [Finding("store.extra_missing", "error", "ownership",
                        f"lease_store_url {redact(url)} names a store whose driver is not "
                        f"installed here: {exc}")]
    except (LeaseError, ValueError) as exc:
        return [Finding("store.unreachable", "error", "ownership",
                        f"lease store {redact(url)} cannot be used: {exc}")]


def _consumer_timeout(app: Any, tasks: list[Any]) -> list[Finding]:
    """RabbitMQ closes the channel of a consumer that holds a delivery unacked longer than
    ``consumer_timeout``; with acks_late a task's message is held for the whole run."""
    limit = RABBITMQ_CONSUMER_TIMEOUT
    unbounded: list[str] = []
    too_long: list[str] = []
    for task in tasks:
        if not task.acks_late:  # acked before it runs: the run holds nothing unacked
            continue
        time_limit = task.time_limit or app.conf.task_time_limit
        if not time_limit:
            unbounded.append(task.name)
        elif float(time_limit) >= limit:
            too_long.append(f"{task.name} ({float(time_limit):g}s)")
    if not unbounded and not too_long:
        return []
    which = "; ".join(
        ([f"no time limit: {', '.join(sorted(unbounded))}"] if unbounded else [])
        + ([f"a time limit of {limit:g}s or more: {', '.join(sorted(too_long))}"]
           if too_long else []))
    return [Finding(
        "broker.consumer_timeout", "warning", "delivery",
        f"tasks with {which}. With task_acks_late a message stays unacked while its task "
        "runs, and RabbitMQ closes the channel of a worker holding one longer than "
        "consumer_timeout and delivers the message again, even while that worker still runs "
        "it (the lease defers the copy; the channel's other unacked messages go back too). "
        "A client cannot read the server's consumer_timeout: this assumes RabbitMQ's default, "
        f"{limit:g}s. Set consumer_timeout above the longest task on the server "
        "(rabbitmq.conf, in ms), or a task time limit below it")]
