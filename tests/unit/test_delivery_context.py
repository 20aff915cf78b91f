"""Where a delivery's outcome goes (``delivery_context``): the same for every copy of one
message, different for the same task id applied in another chain or chord."""

from __future__ import annotations

from typing import Any

from lease_celery.execution.delivery import CONTEXT_HEADER, NOWHERE, delivery_context


def _options(**place: Any) -> dict[str, Any]:
    options: dict[str, Any] = {"task_id": "t-1", "root_id": "t-1", "parent_id": None,
                               "group_id": None, "group_index": None, "chord": None,
                               "chain": None, "link": None, "link_error": None, "retries": 0}
    options.update(place)
    return options


def test_a_delivery_nothing_follows_has_the_one_empty_context() -> None:
    assert delivery_context(_options()) == NOWHERE
    assert delivery_context(_options(link=[], retries=3, root_id="other")) == NOWHERE


def test_copies_of_one_message_share_a_context_whatever_celery_mints_anew() -> None:
    """A retry, a deferral or a callback sent again by its parent's duplicate: new retries,
    parent, root and callback-group ids, the same place."""
    chain = [{"task": "next", "options": {"task_id": "n-1"}}]
    first = delivery_context(_options(chain=chain, group_id="g-1", parent_id="p-1"))
    again = delivery_context(_options(chain=chain, group_id="g-2", parent_id="p-2",
                                      root_id="r-2", retries=1))
    assert first == again != NOWHERE


def test_the_same_id_in_another_chain_or_chord_is_another_place() -> None:
    in_chain = delivery_context(_options(chain=[{"task": "next", "options": {"task_id": "a"}}]))
    other_chain = delivery_context(_options(chain=[{"task": "next",
                                                    "options": {"task_id": "b"}}]))
    in_chord = delivery_context(_options(chord={"task": "body"}, group_index=0))
    with_errback = delivery_context(_options(link_error=[{"task": "on_error"}]))
    assert len({in_chain, other_chain, in_chord, with_errback, NOWHERE}) == 5


def test_a_replacement_keeps_the_context_it_inherits() -> None:
    inherited = delivery_context(_options(link=[{"task": "cb"}]))
    assert delivery_context(_options(), inherited) == inherited
    headers = {CONTEXT_HEADER: inherited}
    assert delivery_context(_options(headers=headers, chain=[{"task": "x"}])) == inherited
