"""``store.effects.find``: the reconciliation queue an operator (or the web dashboard) reads."""

from __future__ import annotations

import pytest

from lease_celery.models import EffectState
from lease_celery.stores.base import Store


@pytest.fixture
def store(stores: list[Store]) -> Store:
    return stores[0]


def test_receipts_are_listed_by_state_newest_first(store: Store) -> None:
    for key in ("e1", "e2", "e3"):
        assert store.effect_insert(key, f"fp-{key}", None)
    e2 = store.effect_get("e2")
    assert e2 is not None and store.effect_update(
        "e2", version=e2.version, state=EffectState.NEEDS_RECONCILIATION, result=None)
    queue = store.effects.find(EffectState.NEEDS_RECONCILIATION)
    assert [(r.key, r.fingerprint) for r in queue] == [("e2", "fp-e2")]
    assert {r.key for r in store.effects.find()} == {"e1", "e2", "e3"}
    assert len(store.effects.find(limit=2)) == 2
    store.effects.resolve("e2", {"sent": True})
    assert store.effects.find(EffectState.NEEDS_RECONCILIATION) == []
