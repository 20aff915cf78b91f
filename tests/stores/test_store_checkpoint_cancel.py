"""The store side of long work: fenced checkpoints and cancellation, on every store; and the
task's side of checkpoints, ``self.lease.checkpoint`` (a LeaseHandle on each store)."""

from __future__ import annotations

import time

import pytest

from lease_celery.checks import encode_checkpoint
from lease_celery.errors import CheckpointNotSerializable, LeaseLost, ResultNotSerializable
from lease_celery.models import Lease, LeaseState
from lease_celery.runtime.execution import Execution
from lease_celery.runtime.handle import LeaseHandle
from lease_celery.stores.base import Store
from lease_celery.testing import ManualClock
from tests.support.tokens import token_base

TASK = {"task": "proj.tasks.long", "args": [1], "kwargs": {}, "options": {"task_id": "t-1"}}


@pytest.fixture
def store(stores: list[Store]) -> Store:
    return stores[0]


def test_a_checkpoint_is_fenced_kept_across_generations_and_cleared_when_done(
        store: Store, clock: ManualClock) -> None:
    """Only the holder's checkpoint is written; a takeover reads the previous generation's,
    the stalled old owner's later write is refused (nothing written), a release keeps it,
    and the finish clears it."""
    first = store.claim("k", owner="w1", ttl=10, task=TASK)
    assert first is not None and store.get("k").checkpoint is None  # type: ignore[union-attr]
    assert store.checkpoint(first, encode_checkpoint({"done": 3}))
    assert store.get("k").checkpoint == {"done": 3}  # type: ignore[union-attr]
    clock.advance(11)  # w1 stalls past its lease
    second = store.claim("k", owner="w2", ttl=10, task=TASK)
    assert second is not None and second.token == token_base(store) + 2
    assert store.get("k").checkpoint == {"done": 3}  # type: ignore[union-attr]
    assert store.checkpoint(first, encode_checkpoint({"done": 4})) is False  # stale: refused
    assert store.get("k").checkpoint == {"done": 3}  # type: ignore[union-attr]
    assert store.checkpoint(second, encode_checkpoint({"done": 5}))
    assert store.release(second, reason="retry")
    assert store.get("k").checkpoint == {"done": 5}  # type: ignore[union-attr]
    third = store.claim("k", owner="w3", ttl=10, task=TASK)
    assert third is not None and store.finish(third, "ok")
    assert store.get("k").checkpoint is None  # type: ignore[union-attr]


def test_a_dead_key_keeps_its_checkpoint_for_the_requeue(store: Store) -> None:
    lease = store.claim("k", owner="w1", ttl=10, task=TASK)
    assert lease is not None and store.checkpoint(lease, encode_checkpoint([1, "two"]))
    assert store.kill(lease, reason="gave up")
    assert store.requeue("k", reason="again") is not None
    again = store.claim("k", owner="w2", ttl=10, task=TASK)
    assert again is not None and store.get("k").checkpoint == [1, "two"]  # type: ignore[union-attr]


def test_a_dead_row_keeps_the_error_it_died_of_and_only_that_one(store: Store) -> None:
    """``kill(error=...)``: the failure as Celery stores it is the dead row's result (a
    duplicate answered with the outcome fails with it); a later death with no error of its
    own (a requeue, then a policy's kill) does not show the earlier one."""
    error = {"exc_type": "RuntimeError", "exc_message": ["boom"], "exc_module": "builtins"}
    lease = store.claim("k", owner="w1", ttl=10, task=TASK)
    assert lease is not None and store.kill(lease, reason="RuntimeError('boom')", error=error)
    assert store.get("k").result == error  # type: ignore[union-attr]
    assert store.requeue("k", reason="again") is not None
    again = store.claim("k", owner="w2", ttl=10, task=TASK)
    assert again is not None and store.kill(again, reason="too many takeovers")
    record = store.get("k")
    assert record is not None and (record.state, record.result) == (LeaseState.DEAD, None)
    with pytest.raises(ResultNotSerializable):
        store.kill(again, reason="x", error={1, 2})


def test_non_json_checkpoints_are_refused_with_a_clear_error() -> None:
    with pytest.raises(CheckpointNotSerializable, match="JSON-serializable; set is not"):
        encode_checkpoint({1, 2})
    with pytest.raises(CheckpointNotSerializable, match="float"):
        encode_checkpoint(float("nan"))


def _handle(store: Store, lease: Lease | None) -> LeaseHandle:
    """``self.lease`` as a body sees it: its local deadline a full ttl away (real time), so
    only the store can tell that the lease was superseded."""
    assert lease is not None
    return Execution(lease, store=store, ttl=10, heartbeat_interval=3,
                     sent_at=time.monotonic()).view


def test_a_superseded_holders_checkpoint_through_its_handle_raises_lease_lost(
        store: Store, clock: ManualClock) -> None:
    """``self.lease.checkpoint`` of a stalled owner whose lease lapsed and was taken over
    (its own local deadline not passed yet) is refused by the store: ``LeaseLost``, the handle
    is marked lost with the reason, and the row keeps the new owner's checkpoint."""
    handle = _handle(store, store.claim("k", owner="w1", ttl=10, task=TASK))
    handle.checkpoint({"done": 1})
    assert store.get("k").checkpoint == {"done": 1}  # type: ignore[union-attr]
    clock.advance(11)  # w1 stalls past its lease
    second = store.claim("k", owner="w2", ttl=10, task=TASK)
    assert second is not None and store.checkpoint(second, encode_checkpoint({"done": 2}))
    held = not handle.lost  # nothing local tells: the store's refusal must
    assert held
    with pytest.raises(LeaseLost, match="checkpoint refused"):
        handle.checkpoint({"done": 9})
    assert "checkpoint refused" in (handle.lost or "")
    assert store.get("k").checkpoint == {"done": 2}  # type: ignore[union-attr]
    assert handle.checkpoint_data == {"done": 1}  # the refused data is nobody's checkpoint
    with pytest.raises(LeaseLost):  # and every later one is refused before the store
        handle.checkpoint({"done": 10})
    assert store.get("k").checkpoint == {"done": 2}  # type: ignore[union-attr]


def test_non_json_data_through_the_handle_is_refused_and_nothing_is_written(
        store: Store) -> None:
    """``self.lease.checkpoint`` of data that is not strict JSON raises
    ``CheckpointNotSerializable`` (a TypeError) naming the offending type or value, before any
    write: the row keeps the last checkpoint and the lease stays held and usable."""
    handle = _handle(store, store.claim("k", owner="w1", ttl=10, task=TASK))
    handle.checkpoint({"done": 1})
    bad = [({"done": 2, "seen": {1, 2}}, "JSON-serializable.*set is not"),
           ({"done": 2, "ratio": float("nan")}, "JSON-serializable.*float"),
           ({"done": 2, "at": object()}, "JSON-serializable.*object is not")]
    for data, problem in bad:
        with pytest.raises(CheckpointNotSerializable, match=problem):
            handle.checkpoint(data)
        assert store.get("k").checkpoint == {"done": 1}  # type: ignore[union-attr]
        assert handle.checkpoint_data == {"done": 1}
    assert not handle.lost
    handle.checkpoint({"done": 2})
    assert store.get("k").checkpoint == {"done": 2}  # type: ignore[union-attr]


def test_cancelling_a_held_key_reaches_its_holder_through_renewals_and_claims(
        store: Store, clock: ManualClock) -> None:
    """A live holder's renewal carries the reason (the lease is still its own, so it can end
    the key dead itself); another claim is still refused; if the holder dies instead, the
    takeover claim carries the reason too, so no later delivery runs the body."""
    lease = store.claim("k", owner="w1", ttl=10, task=TASK)
    assert lease is not None and lease.cancel is None
    assert store.cancel("k", reason="runaway <script>")
    record = store.get("k")
    assert record is not None and record.state is LeaseState.RUNNING
    assert record.cancel == "cancelled: runaway <script>"
    renewed = store.renew(lease, ttl=10)
    assert renewed is not None and renewed.cancel == "cancelled: runaway <script>"
    assert store.claim("k", owner="w2", ttl=10) is None
    clock.advance(11)  # the holder died without acting on it
    taken = store.claim("k", owner="w2", ttl=10, task=TASK)
    assert taken is not None and taken.cancel == "cancelled: runaway <script>"
    assert store.kill(taken, reason=taken.cancel)
    dead = store.get("k")
    assert dead is not None and dead.state is LeaseState.DEAD
    assert dead.reason == "cancelled: runaway <script>"
    assert store.cancel("k", reason="again") is False  # dead: nothing to cancel
    assert store.requeue("k", reason="operator") is not None
    back = store.claim("k", owner="w3", ttl=10, task=TASK)
    assert back is not None and back.cancel is None and back.token == token_base(store) + 3


def test_cancelling_a_key_nobody_holds_kills_it_at_once_and_keeps_its_token(
        store: Store, clock: ManualClock) -> None:
    """No row yet, a ready row, and an expired lease go dead at once (no delivery can claim
    them); a done key is left alone; tokens continue after a requeue."""
    assert store.cancel("fresh", reason="not wanted")
    record = store.get("fresh")
    assert record is not None and record.state is LeaseState.DEAD
    # Token 0: no claim yet (on every store; the base applies to claimed generations).
    assert record.reason == "cancelled: not wanted" and record.token == 0
    assert store.claim("fresh", owner="w", ttl=10) is None
    assert store.requeue("fresh", reason="wanted after all") is not None
    lease = store.claim("fresh", owner="w", ttl=10)
    assert lease is not None and lease.token == token_base(store) + 1 and lease.cancel is None

    ready = store.claim("ready", owner="w", ttl=10, task=TASK)
    assert ready is not None and store.release(ready, reason="backoff", delay=30)
    assert store.cancel("ready", reason="r")
    assert store.get("ready").state is LeaseState.DEAD  # type: ignore[union-attr]

    expired = store.claim("expired", owner="w", ttl=1, task=TASK)
    assert expired is not None
    clock.advance(2)
    assert store.cancel("expired", reason="r")
    assert store.get("expired").state is LeaseState.DEAD  # type: ignore[union-attr]
    assert store.claim("expired", owner="w2", ttl=10) is None

    done = store.claim("done", owner="w", ttl=10, task=TASK)
    assert done is not None and store.finish(done, 1)
    assert store.cancel("done", reason="too late") is False
    assert store.get("done").state is LeaseState.DONE  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="NUL"):
        store.cancel("done", reason="bad\x00reason")
