"""Signals lease_celery sends; connect receivers as with any Celery signal.

Lease signals are sent with ``sender=<the task>`` and ``key``; most also carry ``lease``
(a :class:`~lease_celery.Lease`), and those that end a hold carry ``hold_time`` (seconds since
the claim). Effect signals are sent with ``sender=<the store>`` and the effect's ``key``. Every
signal has a matching metric (``lease_celery.metrics``). Celery's ``Signal.send`` logs and
swallows a receiver's exception, so a faulty receiver never breaks a task.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = [
    "duplicate_answered",
    "duplicate_deferred",
    "duplicate_ignored",
    "effect_conflict",
    "effect_outcome_unknown",
    "effect_performed",
    "effect_replayed",
    "lease_acquired",
    "lease_dead",
    "lease_finished",
    "lease_lost",
    "lease_released",
    "lease_renewed",
    "lease_retry",
    "lease_settled",
    "lease_swept",
    "lease_taken_over",
    "limit_handed_on",
    "limit_wait",
    "settle_completed",
    "stale_result_rejected",
]

#: A claim succeeded: ``lease``.
lease_acquired = Signal(name="lease_acquired")
#: A claim took the key over from an owner whose lease had expired: ``lease``.
lease_taken_over = Signal(name="lease_taken_over")
#: The body finished and its result was accepted: ``lease``.
lease_finished = Signal(name="lease_finished")
#: Celery stored the accepted outcome (and sent callbacks); the owner confirmed it on the
#: lease row, ending the settle phase: ``lease``.
lease_settled = Signal(name="lease_settled")
#: The owner of a finished key died before confirming that Celery stored the outcome; this
#: delivery (same task id) completes it: result or failure stored, callbacks sent with the
#: same ids: ``lease``, ``state`` (``done`` or ``dead``).
settle_completed = Signal(name="settle_completed")
#: A failed attempt released the key with a backoff and was retried: ``reason``, ``countdown``.
lease_retry = Signal(name="lease_retry")
#: The failure policy gave up: the key is dead (a dead letter) until requeued: ``reason``.
lease_dead = Signal(name="lease_dead")
#: The sweeper re-published the task of a lease that expired without renewal: ``record``.
lease_swept = Signal(name="lease_swept")
#: ``effects.once`` ran the action and recorded it: ``key`` (the effect's), ``attempt``.
effect_performed = Signal(name="effect_performed")
#: ``effects.once`` found the action already done and returned the recorded result: ``key``.
effect_replayed = Signal(name="effect_replayed")
#: The same effect key came with another payload; nothing was done: ``key``.
effect_conflict = Signal(name="effect_conflict")
#: An attempt's outcome is unknown; the receipt needs reconciliation: ``key``.
effect_outcome_unknown = Signal(name="effect_outcome_unknown")
#: The heartbeat moved the deadline: ``lease`` (with the new ``expires_at``), ``delay`` (how
#: late the renewal was sent against its schedule, seconds).
lease_renewed = Signal(name="lease_renewed")
#: This process no longer holds the lease: ``lease``, ``reason``.
lease_lost = Signal(name="lease_lost")
#: A delivery found a live holder and was re-published for later: ``countdown``, ``holder``.
duplicate_deferred = Signal(name="duplicate_deferred")
#: A delivery under another task id found the key finished (or dead) and was answered with its
#: accepted outcome, under its own id (``lease_celery.execution.answers``): ``state``,
#: ``record`` (the key's), ``lease`` (the answer's).
duplicate_answered = Signal(name="duplicate_answered")
#: A delivery found the key already finished (or dead) and was dropped: ``state``.
duplicate_ignored = Signal(name="duplicate_ignored")
#: A result (or failure) of a lease that was no longer current was refused: ``lease``, ``reason``.
stale_result_rejected = Signal(name="stale_result_rejected")
#: The lease was given back early (the body raised): ``lease``.
lease_released = Signal(name="lease_released")
#: A delivery over its group's limit was parked as the group's waiter, its message acked
#: (``lease_celery.limits``): ``group``, ``refusal`` (a ``LimitRefused``).
limit_wait = Signal(name="lease_limit_wait")
#: A freed slot published a parked delivery of its group again: ``group``, ``waiter``.
limit_handed_on = Signal(name="lease_limit_handed_on")
