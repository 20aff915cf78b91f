"""``Store.finish_and_claim``: the previous delivery's finish carried by the next one's claim.

On every store (one transaction: SQLite's, one PostgreSQL statement, one Redis script),
each half is judged by its own rule exactly as if sent alone: the finish fenced on its lease,
the claim on its key's row; neither half's refusal changes the other's answer.
"""

from __future__ import annotations

import pytest
import redis

from lease_celery import LeaseState, Store, open_store
from lease_celery.errors import ResultNotSerializable
from lease_celery.testing import ManualClock

TTL = 10.0


def test_the_finish_lands_and_the_next_key_is_claimed(stores: list[Store]) -> None:
    """A current lease's finish is accepted (done, its result, settled at once) and the next
    key is claimed with a new key's first token (1; on Redis the epoch's floor + 1, as the
    first key's), in one call."""
    store = stores[0]
    first = store.claim("carry:1", owner="w", ttl=TTL,
                        task={"options": {"task_id": "t1"}, "context": "c1"})
    assert first is not None
    accepted, second = store.finish_and_claim(first, {"pages": 3}, "carry:2", owner="w",
                                              ttl=TTL, task={"options": {"task_id": "t2"}})
    assert accepted is True
    assert second is not None
    assert (second.key, second.token, second.owner) == ("carry:2", first.token, "w")
    done = store.get("carry:1")
    assert done is not None
    assert (done.state, done.result, done.settling, done.token) == (
        LeaseState.DONE, {"pages": 3}, False, first.token)
    # A settled row keeps its task id and context only.
    assert done.task == {"options": {"task_id": "t1"}, "context": "c1"}
    running = store.get("carry:2")
    assert running is not None and running.state is LeaseState.RUNNING
    history = [entry.event for entry in store.history("carry:1")]
    assert history[-1] == "finished", history


def test_a_stale_finish_is_refused_and_the_claim_still_judged_alone(
        stores: list[Store], clock: ManualClock) -> None:
    """The carried lease expired and was taken over: its finish is refused (the new holder's
    row untouched), and the claim of the next key is granted all the same."""
    store, other = stores
    stale = store.claim("carry:stale", owner="w1", ttl=TTL)
    assert stale is not None
    clock.advance(TTL)  # the deadline instant counts as expired
    taken = other.claim("carry:stale", owner="w2", ttl=TTL)
    assert taken is not None and taken.token == stale.token + 1
    accepted, claimed = store.finish_and_claim(stale, "late", "carry:next", owner="w1", ttl=TTL)
    assert accepted is False
    assert claimed is not None and claimed.key == "carry:next"
    row = store.get("carry:stale")
    assert row is not None
    assert (row.state, row.owner, row.token, row.result) == (
        LeaseState.RUNNING, "w2", taken.token, None)


def test_a_refused_claim_does_not_undo_the_finish(stores: list[Store]) -> None:
    """The next key is held by a live lease: the claim is refused (None) and the carried
    finish still lands."""
    store, other = stores
    mine = store.claim("carry:mine", owner="w1", ttl=TTL)
    held = other.claim("carry:held", owner="w2", ttl=TTL)
    assert mine is not None and held is not None
    accepted, claimed = store.finish_and_claim(mine, 1, "carry:held", owner="w1", ttl=TTL)
    assert (accepted, claimed) == (True, None)
    row = store.get("carry:mine")
    assert row is not None and row.state is LeaseState.DONE and row.result == 1
    row = store.get("carry:held")
    assert row is not None and (row.owner, row.token) == ("w2", held.token)


def test_on_the_same_key_the_finish_comes_first(stores: list[Store]) -> None:
    """A delivery of the very key just finished: the finish lands, and the claim then finds
    the key done and is refused."""
    store = stores[0]
    lease = store.claim("carry:same", owner="w", ttl=TTL)
    assert lease is not None
    accepted, claimed = store.finish_and_claim(lease, "r", "carry:same", owner="w", ttl=TTL)
    assert (accepted, claimed) == (True, None)
    row = store.get("carry:same")
    assert row is not None and (row.state, row.result) == (LeaseState.DONE, "r")


def test_a_result_that_is_not_json_writes_nothing(stores: list[Store]) -> None:
    """As with ``finish``: a result the store cannot hold is refused before either write."""
    store = stores[0]
    lease = store.claim("carry:bad", owner="w", ttl=TTL)
    assert lease is not None
    with pytest.raises(ResultNotSerializable):
        store.finish_and_claim(lease, object(), "carry:after", owner="w", ttl=TTL)
    assert store.get("carry:after") is None
    row = store.get("carry:bad")
    assert row is not None and row.state is LeaseState.RUNNING


def test_redis_a_carrying_script_whose_reply_was_lost_reports_what_it_did(
        redis_store_url: str) -> None:
    """The script ran (the finish landed, the claim was granted) but its reply was lost with
    the connection: the store sends it once more, and that copy, judged against the first
    one's effect, is refused both ways. The caller is still told the truth: accepted, and the
    lease the first copy granted (its nonce is on the row)."""
    with open_store(redis_store_url) as store:
        caller = store._caller  # type: ignore[attr-defined]
        carrying = store._scripts["finish_and_claim"]  # type: ignore[attr-defined]
        real, lost = caller.run, []

        def losing(script: object, keys: object, args: object, **kw: object) -> object:
            answer = real(script, keys, args, **kw)
            if not lost and script is carrying:
                lost.append(answer)
                raise redis.ConnectionError("test: the reply was lost")
            return answer

        first = store.claim("carry:lost", owner="w", ttl=TTL)
        assert first is not None
        caller.run = losing
        accepted, claimed = store.finish_and_claim(first, "r", "carry:lost-next", owner="w",
                                                   ttl=TTL)
        assert lost, "the carrying script was not sent"
        row = store.get("carry:lost-next")
        assert row is not None and row.state is LeaseState.RUNNING
        assert accepted is True
        assert claimed is not None and (claimed.token, claimed.owner) == (row.token, "w")
        done = store.get("carry:lost")
        assert done is not None and (done.state, done.result) == (LeaseState.DONE, "r")
