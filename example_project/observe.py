"""Signal receivers that write the demo's timeline from inside the workers.

Celery's own signals say which worker received, started and finished which delivery;
lease_celery's signals say who claimed, renewed, lost, deferred, ignored, swept or was
refused, and which outside action a receipt performed or replayed. A receiver never breaks a
task (both libraries log and swallow a receiver's exception), so this module observes and
never steers.
"""

from __future__ import annotations

from typing import Any

from celery import signals as celery_signals

from lease_celery import signals as lease_signals

from . import timeline


@celery_signals.worker_ready.connect
def _worker_ready(sender: Any = None, **_: Any) -> None:
    timeline.record("worker_ready", worker=getattr(sender, "hostname", None))


@celery_signals.task_received.connect
def _received(request: Any = None, **_: Any) -> None:
    # Runs in the worker's main process when it takes a message off the broker.
    delivery_info = getattr(request, "delivery_info", None) or {}
    timeline.record("received", worker=request.hostname, task_id=request.id,
                    task=request.name, eta=request.eta,
                    redelivered=bool(delivery_info.get("redelivered")))


@celery_signals.task_prerun.connect
def _prerun(task_id: str | None = None, task: Any = None, args: Any = None,
            kwargs: Any = None, **_: Any) -> None:
    # ``demo_copy`` is a message header the demo puts on the deliveries it publishes (a copy
    # that LeasedTask re-publishes keeps it); ``redelivered`` is the broker's own flag.
    delivery_info = task.request.delivery_info or {}
    timeline.record("prerun", worker=task.request.hostname, task_id=task_id, task=task.name,
                    args=list(args or ()), copy=getattr(task.request, "demo_copy", None),
                    eta=task.request.eta, redelivered=bool(delivery_info.get("redelivered")))


@celery_signals.task_postrun.connect
def _postrun(task_id: str | None = None, task: Any = None, state: str | None = None,
             **_: Any) -> None:
    timeline.record("postrun", worker=task.request.hostname, task_id=task_id, task=task.name,
                    state=state)


def _lease_fields(lease: Any) -> dict[str, Any]:
    if lease is None:
        return {}
    return {"token": lease.token, "owner": lease.owner, "expires_at": lease.expires_at}


def _connect(name: str) -> None:
    def receiver(sender: Any = None, key: str | None = None, lease: Any = None,
                 **fields: Any) -> None:
        fields.pop("signal", None)
        record = fields.pop("record", None)  # duplicate_ignored, lease_swept: the row
        if record is not None:
            fields["record_token"], fields["record_owner"] = record.token, record.owner
        timeline.record(name, key=key, **_lease_fields(lease), **fields)

    getattr(lease_signals, name).connect(receiver, weak=False)


# lease_swept comes from a worker's main process (its sweeper thread); the effect signals carry
# the effect's business key (``publish:report:…:v1``) instead of a lease key.
for _name in ("lease_acquired", "lease_renewed", "lease_lost", "lease_released",
              "duplicate_deferred", "duplicate_ignored", "stale_result_rejected", "lease_swept",
              "effect_performed", "effect_replayed", "effect_outcome_unknown"):
    _connect(_name)
