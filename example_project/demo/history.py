"""Turn a run's timeline events into facts: executions, lease spans, deferrals.

Pool processes run one delivery at a time (``-c 1``), so everything a process records between
its ``prerun`` and its ``postrun`` belongs to that delivery. Lease renewals come from the
heartbeat thread of the same process and are matched by key and token instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..timeline import Event

__all__ = ["Execution", "History", "LeaseSpan", "report_of_key"]


def report_of_key(key: str | None) -> int | None:
    """``report:<edition>:<id>`` (a lease) or ``publish:report:<edition>:<id>:v1`` -> id."""
    if not key:
        return None
    parts = key.split(":")
    if key.startswith("report:") and len(parts) == 3:
        value = parts[2]
    elif key.startswith("publish:report:") and len(parts) == 5:
        value = parts[3]
    else:
        return None
    try:
        return int(value)
    except ValueError:
        return None


@dataclass
class Execution:
    """One run of a task body: from ``body_start`` to its end, however it ended."""

    report_id: int
    worker: str
    pid: int
    task_id: str
    copy: str | None          # which of the demo's deliveries ("1", "2") this one descends from
    started: float
    redelivered: bool = False  # the broker redelivered the message (after a worker died)
    origin: str = "demo"       # who published the message it runs: see History._origin
    token: int | None = None
    ended: float | None = None
    state: str | None = None  # Celery's postrun state: SUCCESS, IGNORED, FAILURE
    published: float | None = None
    written: float | None = None
    overwrote_newer: bool = False
    killed: float | None = None
    stalled: float | None = None
    resumed: float | None = None
    lease_lost: float | None = None
    refused: float | None = None
    refused_reason: str | None = None

    @property
    def end(self) -> float | None:
        return self.killed if self.killed is not None else self.ended


@dataclass
class LeaseSpan:
    """One claim of one key: from acquisition to the last deadline the store granted."""

    report_id: int
    token: int
    pid: int
    acquired: float
    expires_at: float
    finished: float | None = None


@dataclass
class History:
    events: list[Event]
    executions: list[Execution] = field(default_factory=list)
    leases: list[LeaseSpan] = field(default_factory=list)

    @classmethod
    def parse(cls, events: list[Event]) -> History:
        history = cls(events=sorted(events, key=lambda e: e["t"]))
        history._build()
        return history

    def of(self, name: str, **match: object) -> list[Event]:
        return [e for e in self.events if e["event"] == name
                and all(e.get(k) == v for k, v in match.items())]

    def for_report(self, name: str, report_id: int) -> list[Event]:
        return [e for e in self.events if e["event"] == name
                and (e.get("report_id") == report_id or report_of_key(e.get("key")) == report_id)]

    def executions_of(self, report_id: int) -> list[Execution]:
        return [x for x in self.executions if x.report_id == report_id]

    def _build(self) -> None:
        copies: dict[int, Event] = {}            # pid -> prerun of the delivery it runs
        seen: set[tuple[str, str]] = set()       # (task id, copy) the demo's publish ran as
        running: dict[int, Execution] = {}       # pid -> the body it is running
        spans: dict[tuple[int, int], LeaseSpan] = {}
        for event in self.events:
            name, pid = event["event"], int(event.get("pid", -1))
            current = running.get(pid)
            if name == "prerun":
                copies[pid] = {**event, "origin": self._origin(event, seen)}
            elif name == "body_start":
                prerun = copies.get(pid, {})
                execution = Execution(
                    report_id=event["report_id"], worker=event.get("worker") or "?", pid=pid,
                    task_id=event["task_id"], copy=prerun.get("copy"), started=event["t"],
                    redelivered=bool(prerun.get("redelivered")), token=event.get("token"),
                    origin=prerun.get("origin", "demo"))
                self.executions.append(execution)
                running[pid] = execution
            elif name == "effect_sent" and current:
                current.published = event["t"]
            elif name == "result_written" and current:
                current.written = event["t"]
                current.overwrote_newer = bool(event.get("overwrote_newer"))
            elif name == "stale_result_rejected" and current:
                current.refused, current.refused_reason = event["t"], event.get("reason")
            elif name == "lease_lost":
                target = current or self._last(pid, event.get("token"))
                if target is not None and target.lease_lost is None:
                    target.lease_lost = event["t"]
            elif name == "postrun" and current:
                current.ended, current.state = event["t"], event.get("state")
                running.pop(pid)
            elif name == "worker_killed":
                for victim in event.get("pids", []):
                    if victim in running:
                        running.pop(victim).killed = event["t"]
            elif name in ("stalled", "resumed") and event.get("target") in running:
                setattr(running[event["target"]], name, event["t"])
            if name in ("lease_acquired", "lease_renewed"):
                self._lease(spans, event)
            if name == "postrun" and event.get("state") == "SUCCESS":
                for span in spans.values():
                    if span.pid == pid and span.finished is None:
                        span.finished = event["t"]
                        span.expires_at = min(span.expires_at, event["t"])
        self.leases = sorted(spans.values(), key=lambda s: s.acquired)

    @staticmethod
    def _origin(prerun: Event, seen: set[tuple[str, str]]) -> str:
        """Who published the message a pool process is about to run.

        ``broker``: the broker's own redelivery (its ``redelivered`` flag). ``deferred``: a
        re-publish with a countdown (LeasedTask deferring a duplicate: the message has an ETA).
        ``demo``: the first run of a delivery the demo published. ``sweeper``: another message
        with the same task id and copy, without an ETA: only the sweeper publishes those (it
        re-publishes the delivery recorded on the lease row, which had no ETA of its own).
        """
        if prerun.get("redelivered"):
            return "broker"
        if prerun.get("eta"):
            return "deferred"
        ident = (str(prerun.get("task_id")), str(prerun.get("copy")))
        if ident in seen:
            return "sweeper"
        seen.add(ident)
        return "demo"

    def _last(self, pid: int, token: object) -> Execution | None:
        for execution in reversed(self.executions):
            if execution.pid == pid and execution.token == token:
                return execution
        return None

    @staticmethod
    def _lease(spans: dict[tuple[int, int], LeaseSpan], event: Event) -> None:
        report_id = report_of_key(event.get("key"))
        token, expires_at = event.get("token"), event.get("expires_at")
        if report_id is None or token is None or expires_at is None:
            return
        span = spans.get((report_id, token))
        if span is None:
            spans[report_id, token] = LeaseSpan(report_id, token, event["pid"], event["t"],
                                                expires_at)
        elif span.finished is None:
            span.expires_at = max(span.expires_at, expires_at)
