"""What the harness publishes, and when: originals spread over the window, plus duplicates.

Every job is published once as an *original* (its own task id). Some are published again:

- a *resend*: the same task id, arguments and links again (a re-sent message, as a producer
  retry or a broker redelivery would deliver it). Half of them follow the original closely, to
  race its claim and its result write; the others come later, when it is usually done.
- an *alias*: a new task id with the same arguments, so the same ``lease_key`` (the same work
  published twice by two producers).

Each publication links the two callbacks (``chaos.on_done``, ``chaos.on_done_plain``). With
``record`` (``--record-at-publish``) each goes through the LeasedTask's ``apply_async`` with
``lease_record=True``: the key's row is written before the message, so a message the broker
loses (a worker killed between kombu's pop and its unacked record) is re-published by the
sweeper; without it, by name (``send_task``), as a producer without the task's code would.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from .config import CALLBACK_TASK, JOB_TASK, PLAIN_CALLBACK_TASK, job_key

__all__ = ["Publication", "Publisher", "plan_publications"]


@dataclass(frozen=True)
class Publication:
    at: float  # seconds after the start of publishing
    task_id: str
    job: str
    kind: str  # "original" | "resend" | "alias"
    sleep_ms: int

    @property
    def key(self) -> str:
        return job_key(self.job)


def _task_id(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def plan_publications(tasks: int, seconds: float, rng: random.Random, *,
                      resend_fraction: float = 0.1,
                      alias_fraction: float = 0.1) -> list[Publication]:
    originals = [Publication(at=seconds * n / max(tasks, 1), task_id=_task_id(rng),
                             job=f"j{n:05d}", kind="original", sleep_ms=rng.randint(0, 300))
                 for n in range(tasks)]
    duplicates = []
    for kind, fraction in (("resend", resend_fraction), ("alias", alias_fraction)):
        for original in rng.sample(originals, k=round(tasks * fraction)):
            late = rng.random() < 0.5
            delay = rng.uniform(0.3, 3.0) if late else rng.uniform(0.0, 0.3)
            task_id = original.task_id if kind == "resend" else _task_id(rng)
            duplicates.append(dataclasses.replace(original, at=original.at + delay,
                                                  task_id=task_id, kind=kind))
    return sorted(originals + duplicates, key=lambda p: p.at)


def recording_task(client: Any) -> Any:
    """``chaos.job`` as a LeasedTask of the harness's app, keyed as the workers' is, so that
    its ``apply_async`` writes the row at publish (the body runs in the workers only)."""
    from lease_celery import LeasedTask

    @client.task(base=LeasedTask, bind=True, name=JOB_TASK, lease_key="job:{job}", shared=False)
    def job(self: Any, job: str, sleep_ms: int) -> None:
        raise AssertionError("chaos.job runs in the workers (benchmarks/chaos/app.py)")

    return job


class Publisher(threading.Thread):
    """Publishes the plan on time (late publications go out at once) until done or stopped."""

    def __init__(self, client: Any, plan: list[Publication], *, record: bool = False) -> None:
        super().__init__(name="chaos-publisher", daemon=True)
        self.client, self.plan = client, plan
        self.task = recording_task(client) if record else None
        self.published: list[Publication] = []
        self.errors: list[str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        # send_task publishes by name, without the task's task_default_priority: given here,
        # as a user publishing by name gives it (--conf task_default_priority=5).
        priority = self.client.conf.task_default_priority
        options = {} if priority is None else {"priority": int(priority)}
        for publication in self.plan:
            pause = start + publication.at - time.monotonic()
            if pause > 0 and self._halt.wait(pause):
                return
            links = [self.client.signature(CALLBACK_TASK),
                     self.client.signature(PLAIN_CALLBACK_TASK)]
            args = (publication.job, publication.sleep_ms)
            try:
                if self.task is not None:
                    self.task.apply_async(args, task_id=publication.task_id, link=links,
                                          lease_record=True, **options)
                else:
                    self.client.send_task(JOB_TASK, args=args, task_id=publication.task_id,
                                          link=links, **options)
            except Exception as exc:  # the broker is not faulted: report, do not hide it
                self.errors.append(f"{publication.task_id}: {exc!r}")
                continue
            self.published.append(publication)

    def stop(self) -> None:
        self._halt.set()
