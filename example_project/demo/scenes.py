"""The story: three scenes, played the same way whatever the task and the broker.

Every scene publishes each of its reports twice with the same task id, as a broker redelivers
a message. What differs between the modes is only what the task does with the second copy,
and with a worker that comes back from the dead or from a stall.
"""

from __future__ import annotations

import time
from collections import Counter

from ..receiver import received
from .history import Execution, History
from .stage import Stage

__all__ = ["crash", "duplicates", "redelivery_note", "stall"]

#: How long a scene may wait for one expected event (generous: CI machines are slow).
STEP_TIMEOUT = 15.0


def duplicates(stage: Stage, report_ids: list[int]) -> None:
    """Scene 1: each report published a second time once its first delivery has started."""
    which = (f"reports {_ids(report_ids)}, each" if len(report_ids) > 1
             else f"report {report_ids[0]},")
    stage.say(f"scene 1 · the same task delivered twice: {which} published again (same task "
              "id) once a worker runs it, as a broker redelivers an unacked message")
    task_ids = {r: stage.publish(r, copy=1) for r in report_ids}
    pending = set(report_ids)
    while pending:
        started = stage.wait(lambda h: sorted(r for r in pending if h.executions_of(r)),
                             timeout=STEP_TIMEOUT, what=f"reports {sorted(pending)} to start")
        for report_id in started:
            stage.publish(report_id, copy=2, task_id=task_ids[report_id])
            pending.discard(report_id)
    stage.settle()
    _narrate(stage, report_ids)


def crash(stage: Stage, report_id: int) -> None:
    """Scene 2: the worker running a report is SIGKILLed mid-build."""
    stage.say(f"scene 2 · a worker SIGKILLed in the middle of a task: report {report_id}")
    task_id = stage.publish(report_id, copy=1)
    first = stage.wait(lambda h: _first(h, report_id), timeout=STEP_TIMEOUT,
                       what=f"report {report_id} to start")
    stage.say(f"  {_who(first)} started building report {report_id}")
    stage.publish(report_id, copy=2, task_id=task_id)
    stage.say(f"  the same message delivered again while {_short(first.worker)} runs it")
    _show_second_copy(stage, report_id, first)
    # Mid-build: well after the second copy was handled, well before the body would publish.
    stage.wait(lambda h: time.time() >= first.started + stage.build_seconds / 2,
               timeout=STEP_TIMEOUT, what="the middle of the build")
    worker = stage.worker(first.worker)
    pids = stage.kill(worker)
    stage.say(f"  SIGKILL {worker.name} (worker pid {pids[0]} and its pool process "
              f"{', '.join(map(str, pids[1:])) or '?'}), "
              f"{time.time() - first.started:.1f}s into the build")
    stage.say(f"  {redelivery_note(stage.broker_url)}")
    stage.settle()
    _narrate(stage, [report_id])
    _conclude_crash(stage, stage.refresh().executions_of(report_id))


def stall(stage: Stage, report_id: int) -> None:
    """Scene 3: the pool process running a report stops (SIGSTOP) past its lease, then resumes."""
    stage.say(f"scene 3 · a worker stalled past its lease, then carrying on: report {report_id}")
    task_id = stage.publish(report_id, copy=1)
    first = stage.wait(lambda h: _first(h, report_id), timeout=STEP_TIMEOUT,
                       what=f"report {report_id} to start")
    stage.say(f"  {_who(first)} started building report {report_id}")
    if stage.mode.leased:
        # Stop it just after a renewal: a process stopped inside a SQLite write transaction
        # would hold the store's write lock and block every other worker (see README).
        stage.wait(lambda h: any(e["pid"] == first.pid and e["t"] > first.started
                                 for e in h.for_report("lease_renewed", report_id)),
                   timeout=STEP_TIMEOUT, what="a lease renewal")
    else:
        stage.wait(lambda h: time.time() >= first.started + 0.5, timeout=STEP_TIMEOUT,
                   what="half a second of build")
    stage.stop_process(first.pid)
    stopped_at = time.time()
    heartbeat = "; its lease heartbeat stops with it" if stage.mode.leased else ""
    stage.say(f"  SIGSTOP pool process {first.pid} of {_short(first.worker)}: frozen mid-build "
              f"(think GC pause, swapped-out VM, paused container){heartbeat}")
    stage.publish(report_id, copy=2, task_id=task_id)
    stage.say(f"  the same message delivered again while {_short(first.worker)} is silent")

    def other_copy_done(history: History) -> Execution | None:
        if time.time() < stopped_at + stage.ttl + 0.5:
            return None  # stalled past the lease in every mode, not just long enough
        for execution in history.executions_of(report_id):
            if execution.pid != first.pid and execution.state == "SUCCESS":
                return execution
        return None

    winner = stage.wait(other_copy_done, timeout=STEP_TIMEOUT,
                        what="another worker to finish the report")
    outcome = (f"with token {winner.token}; result accepted by the lease store"
               if stage.mode.leased else "and wrote its result")
    stage.say(f"  {_who(winner)} built and published the report {outcome}")
    stage.continue_process(first.pid)
    stage.say(f"  SIGCONT pool process {first.pid}: it wakes up "
              f"{time.time() - stopped_at:.1f}s later (longer than the {stage.ttl:g}s lease) "
              "and carries on with its old build")
    stage.settle()
    _narrate(stage, [report_id])


def redelivery_note(broker_url: str) -> str:
    """What this broker does with the message of a worker that was SIGKILLed."""
    if broker_url.startswith("filesystem"):
        return ("filesystem transport: it deleted the message when the worker fetched it, so "
                "it can never redeliver it")
    if broker_url.startswith(("redis", "rediss")):
        return ("Redis: restores a dead worker's unacked message only after visibility_timeout "
                "(1 h by default) and a restore sweep: not within this demo")
    if broker_url.startswith(("amqp", "pyamqp")):
        return ("RabbitMQ: requeues a dead consumer's unacked message at once: expect a real "
                "redelivery below")
    return "this broker's redelivery rules decide whether the killed delivery comes back"


# -- narration ---------------------------------------------------------------------------------

def _conclude_crash(stage: Stage, executions: list[Execution]) -> None:
    done = [x for x in executions if x.state == "SUCCESS"]
    if not done:
        stage.say("  → the report is lost: no delivery of it finished")
        return
    winner = done[-1]
    if stage.mode.leased:
        stage.say(f"  → nothing lost: the {_copy(winner)} found the lease held, was deferred "
                  f"(re-published, not dropped) and took over with token {winner.token} once the "
                  "dead owner's lease expired. Without a second delivery this report would be "
                  "lost in both modes on a broker that cannot redeliver; a coming sweeper "
                  "re-publishes expired leases.")
    elif any(x.redelivered for x in done):
        stage.say(f"  → the broker redelivered the killed message and the plain task built the "
                  f"report again beside the duplicate: {len(executions)} builds for one report")
    else:
        stage.say("  → the report exists only because a duplicate happened to be running "
                  "alongside the killed build: this broker will never give the killed one back")


def _show_second_copy(stage: Stage, report_id: int, first: Execution) -> None:
    if stage.mode.leased:
        deferred = stage.wait(
            lambda h: h.for_report("duplicate_deferred", report_id), timeout=STEP_TIMEOUT,
            what="the second copy to be deferred")[0]
        stage.say(f"  {_short(_worker_of(stage, deferred['pid']))}: lease held by "
                  f"{_short(first.worker)} → deferred (re-published to run in "
                  f"{deferred['countdown']:.1f}s), not dropped")
    else:
        second = stage.wait(
            lambda h: next((x for x in h.executions_of(report_id) if x.pid != first.pid), None),
            timeout=STEP_TIMEOUT, what="the second copy to start")
        stage.say(f"  {_who(second)} started a second build at once")


def _narrate(stage: Stage, report_ids: list[int]) -> None:
    history = stage.refresh()
    counts = Counter(r["report_id"] for r in received(stage.receiver_url, stage.edition))
    for report_id in report_ids:
        stage.say(f"  report {report_id}:")
        for execution in history.executions_of(report_id):
            stage.say(f"    {_who(execution)}, {_copy(execution)}: "
                      f"{_outcome(execution, leased=stage.mode.leased)}")
        deferred = len(history.for_report("duplicate_deferred", report_id))
        ignored = len(history.for_report("duplicate_ignored", report_id))
        if deferred or ignored:
            stage.say(f"    deliveries deferred {deferred}×, dropped as already done {ignored}×")
        n = counts.get(report_id, 0)
        flag = f" ← {n - 1} duplicate effect{'s' if n > 2 else ''}" if n > 1 else ""
        stage.say(f"    the outside service received it {n}×{flag}")


def _outcome(x: Execution, *, leased: bool) -> str:
    steps = []
    if x.stalled is not None:
        frozen = (x.resumed or time.time()) - x.stalled
        steps.append(f"stalled {frozen:.1f}s")
    if x.killed is not None:
        steps.append(f"SIGKILLed {x.killed - x.started:.1f}s into the build")
        return ", ".join(steps)
    if x.refused is not None and x.published is None:
        steps.append("found its lease lost at the check before publishing and stopped; the "
                     "lease store refused its outcome (stale)")
        return ", ".join(steps)
    if x.published is not None:
        steps.append("published")
    if leased:
        if x.state == "SUCCESS":
            steps.append("result accepted by the lease store")
        elif x.refused is not None:
            steps.append("result refused by the lease store (stale)")
    elif x.written is not None:
        steps.append("wrote its result over a newer build (stale write accepted)"
                     if x.overwrote_newer else "wrote its result")
    if x.state == "FAILURE":
        steps.append("failed")
    return ", ".join(steps) or (x.state or "running")


def _first(history: History, report_id: int) -> Execution | None:
    executions = history.executions_of(report_id)
    return executions[0] if executions else None


def _who(x: Execution) -> str:
    token = f" token {x.token}" if x.token is not None else ""
    return f"{_short(x.worker)} pid {x.pid}{token}"


def _copy(x: Execution) -> str:
    name = {"1": "first delivery", "2": "second delivery"}.get(x.copy or "", "delivery")
    return f"{name} (redelivered by the broker)" if x.redelivered else name


def _short(hostname: str) -> str:
    return hostname.split("@", 1)[0]


def _worker_of(stage: Stage, pid: int) -> str:
    for event in stage.events:
        if event.get("pid") == pid and event["event"] == "prerun":
            return str(event.get("worker"))
    return f"pid {pid}"


def _ids(ids: list[int]) -> str:
    return f"{ids[0]}–{ids[-1]}" if len(ids) > 1 else str(ids[0])
