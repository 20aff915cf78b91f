"""The reference model and every store, driven by the same operations (the short profile of
``tests/stores/model_machine.py``): every answer and every row must agree."""

from __future__ import annotations

import pytest

from tests.conftest import STORES
from tests.stores.model_machine import run


@pytest.mark.parametrize("kind", STORES)
def test_every_store_answers_as_the_model_does(kind: str) -> None:
    """Claims, renewals, finishes (carried by a claim too), releases, kills, settle phases,
    operator actions, the sweeper, retention, effect receipts and limits, on a clock that
    jumps and stops exactly at deadlines, with owner names reused, under restarts, killed
    connections, lost replies and (Redis) a server that lost its data: the store's answers
    and rows are the model's."""
    run(kind, "short")
