"""The story: three scenes, played the same way whatever the task and the broker.

Scenes 1 and 3 publish each of their reports twice with the same task id, as a broker
redelivers a message; scene 2 publishes its report once and kills the worker that runs it.
What differs between the modes is only what the task does with the second copy, with a worker
that comes back from a stall, and what is left to recover a task whose worker died.
"""

from __future__ import annotations

import time
from collections import Counter

from ..receiver import received
from .history import Execution, History
from .stage import Stage

__all__ = ["duplicates", "lone_kill", "stall"]

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


def lone_kill(stage: Stage, report_id: int) -> None:
    """Scene 2: a report published once; the whole worker running it is SIGKILLed mid-build."""
    stage.say(f"scene 2 · a lone delivery, its whole worker SIGKILLed mid-task: report "
              f"{report_id}, published once (no duplicate to fall back on)")
    stage.publish(report_id, copy=1)
    first = stage.wait(lambda h: _first(h, report_id), timeout=STEP_TIMEOUT,
                       what=f"report {report_id} to start")
    stage.say(f"  {_who(first)} started building report {report_id}")
    # Mid-build: well before the body would publish.
    stage.wait(lambda h: time.time() >= first.started + stage.build_seconds / 2,
               timeout=STEP_TIMEOUT, what="the middle of the build")
    worker = stage.worker(first.worker)
    pids = stage.kill(worker)
    killed_at = time.time()
    stage.say(f"  SIGKILL {worker.name} (worker pid {pids[0]} and its pool process "
              f"{', '.join(map(str, pids[1:])) or '?'}, as the OOM killer would), "
              f"{killed_at - first.started:.1f}s into the build")
    stage.say(f"  {stage.broker.on_kill()}")
    # The time LeasedTask needs at most to notice: the lease runs out, then a sweep finds it.
    window = stage.ttl + stage.sweep_interval
    if stage.mode.leased:
        stage.say(f"  its lease (token {first.token}) is no longer renewed and expires within "
                  f"{stage.ttl:g}s; the sweeper thread in each other worker's main process looks "
                  f"for expired leases every {stage.sweep_interval:g}s")

        def recovered(history: History) -> Execution | None:
            return next((x for x in history.executions_of(report_id)
                         if x.pid != first.pid and x.state == "SUCCESS"), None)

        winner = stage.wait(recovered, timeout=window + stage.build_seconds + STEP_TIMEOUT,
                            what=f"report {report_id} to be recovered")
        for sweep in stage.refresh().for_report("lease_swept", report_id):
            sweeper = stage.worker_by_pid(sweep["pid"])
            stage.say(f"  {sweeper.name if sweeper else 'pid ' + str(sweep['pid'])}'s sweeper, "
                      f"{sweep['t'] - killed_at:.1f}s after the SIGKILL: lease token "
                      f"{sweep.get('record_token')} of {_owner(stage, sweep.get('record_owner'))} "
                      "expired without renewal → re-published the task recorded on the lease "
                      "row (same task id), once for that token")
        stage.say(f"  {_who(winner)} ran the {_copy(winner, lone=True)}: took the key over, "
                  "built, published through its receipt, result accepted by the lease store")
    else:
        stage.wait(lambda h: time.time() >= killed_at + window, timeout=window + STEP_TIMEOUT,
                   what="the recovery window")
        again = [x for x in stage.refresh().executions_of(report_id) if x.pid != first.pid]
        runs = f"{len(again)} other run(s)" if again else "no other run"
        stage.say(f"  waited {window:g}s (a lease ttl plus one sweep interval: what LeasedTask "
                  f"needs to notice): {runs} of report {report_id}")
    stage.settle()
    holds = stage.broker.holds(stage.queue)
    if holds:
        stage.say(f"  the broker now: {holds}")
    _narrate(stage, [report_id])
    _conclude_lone_kill(stage, stage.refresh().executions_of(report_id))


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
    outcome = ("(through its receipt); result accepted by the lease store"
               if stage.mode.leased else "and wrote its result")
    stage.say(f"  {_who(winner)}, {_copy(winner)}, built and published the report {outcome}")
    stage.continue_process(first.pid)
    stage.say(f"  SIGCONT pool process {first.pid}: it wakes up "
              f"{time.time() - stopped_at:.1f}s later (longer than the {stage.ttl:g}s lease) "
              "and carries on with its old build")
    stage.settle()
    _narrate(stage, [report_id])


# -- narration ---------------------------------------------------------------------------------

def _conclude_lone_kill(stage: Stage, executions: list[Execution]) -> None:
    done = [x for x in executions if x.state == "SUCCESS"]
    report_id = executions[0].report_id
    if not done:
        if stage.mode.leased:
            why = "no delivery of it finished"
        elif stage.broker.kind == "redis":
            why = ("its only message sits in Redis unacked until visibility_timeout; within the "
                   "demo nothing runs it, and a plain task leaves no record that it was running")
        else:
            why = ("its only message died with the worker, and a plain task leaves no record "
                   "that it was ever running")
        stage.say(f"  → report {report_id} is lost: {why}")
        return
    winner = done[-1]
    if not stage.mode.leased:
        stage.say(f"  → the broker redelivered the killed message and the plain task built "
                  f"report {report_id} again: not lost on this broker")
        return
    stage.say(f"  → nothing lost: the {_copy(winner, lone=True)} did the work with token "
              f"{winner.token}. {stage.broker.later()}: that redelivery finds the key done and "
              "is dropped (Ignore); one that arrives before the dead owner's lease has expired "
              "is deferred first")


def _narrate(stage: Stage, report_ids: list[int]) -> None:
    history = stage.refresh()
    counts = Counter(r["report_id"] for r in received(stage.receiver_url, stage.edition))
    for report_id in report_ids:
        stage.say(f"  report {report_id}:")
        lone = len(history.for_report("published", report_id)) == 1
        for execution in history.executions_of(report_id):
            stage.say(f"    {_who(execution)}, {_copy(execution, lone=lone)}: "
                      f"{_outcome(execution, leased=stage.mode.leased)}")
        deferred = len(history.for_report("duplicate_deferred", report_id))
        ignored = len(history.for_report("duplicate_ignored", report_id))
        swept = len(history.for_report("lease_swept", report_id))
        if deferred or ignored or swept:
            also = f", re-published by a sweeper {swept}×" if swept else ""
            stage.say(f"    deliveries deferred {deferred}×, dropped as already done "
                      f"{ignored}×{also}")
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


def _copy(x: Execution, *, lone: bool = False) -> str:
    """Which delivery an execution ran, and who published the message it came in."""
    name = ("only delivery" if lone else
            {"1": "first delivery", "2": "second delivery"}.get(x.copy or "", "delivery"))
    if x.origin == "sweeper":
        return f"sweeper's re-publish of the {name}"
    if x.origin == "broker":
        return f"{name}, redelivered by the broker"
    if x.origin == "deferred":
        return f"{name}, back after its deferral"
    return name


def _short(hostname: str) -> str:
    return hostname.split("@", 1)[0]


def _owner(stage: Stage, owner: object) -> str:
    """A lease owner (``hostname:pid:uuid4``) as the worker and pool process it was."""
    try:
        pid = int(str(owner).split(":")[-2])
    except (IndexError, ValueError):
        return str(owner)
    running = next((x for x in stage.refresh().executions if x.pid == pid), None)
    return f"{_short(running.worker)} pid {pid}" if running else f"pid {pid}"


def _ids(ids: list[int]) -> str:
    return f"{ids[0]}–{ids[-1]}" if len(ids) > 1 else str(ids[0])
