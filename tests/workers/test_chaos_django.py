"""The chaos harness's ``django-tx`` variant, judged on doctored histories: each check that
reads its Django models (``app_rows``, ``stale_app_row`` on the orders, ``order_payment`` on
their payments) fails on its defect. No Django here: the checker reads plain data. The run
itself is tests/django_integration/test_chaos_run.py.

The history is test_chaos.py's clean one, told as a ``django-tx`` run: each done job has its
one order, of the key's final token, with its one payment of the same token; the dead job
(j3, an effect whose outcome became unknown) has none.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest

from benchmarks.chaos.checker import check
from benchmarks.chaos.config import DJANGO_VARIANT
from benchmarks.chaos.faults import parse_faults
from benchmarks.chaos.history import History, Row
from benchmarks.chaos.txchecks import VARIANT_CHECKS
from tests.workers.test_chaos import A, C, clean_history
from tests.workers.test_chaos_tx import tx_history


def django_history() -> History:
    history = clean_history()
    history.variant = DJANGO_VARIANT
    history.rows["job:j1"] = Row("job:j1", "done", 2, "w:21:x", None, 2, 1, {"token": 2})
    history.rows["job:j2"] = Row("job:j2", "done", 1, "w:12:x", None, 1, 0, {"token": 1})
    history.app_rows = {"j1": [{"token": 2, "pid": 21, "task_id": A, "payments": [2]}],
                        "j2": [{"token": 1, "pid": 12, "task_id": C, "payments": [1]}]}
    return history


def _order(job: str, token: int) -> Callable[[History], None]:
    return lambda h: h.app_rows.setdefault(job, []).append(
        {"token": token, "pid": 1, "task_id": "x", "payments": [token]})


def _payments(job: str, payments: list[int]) -> Callable[[History], None]:
    def doctor(h: History) -> None:
        h.app_rows[job][0]["payments"] = payments
    return doctor


def _no_order(h: History) -> None:
    del h.app_rows["j2"]


def _stale_order(h: History) -> None:
    h.app_rows["j1"] = [{"token": 1, "pid": 11, "task_id": A, "payments": [1]}]


def _stale_result(h: History) -> None:
    h.rows["job:j1"] = Row("job:j1", "done", 2, "w:21:x", None, 2, 1, {"token": 1})


DEFECTS: dict[str, tuple[str, Callable[[History], None]]] = {
    "a done key without its order": ("app_rows", _no_order),
    "two orders for one key (a block committed twice)": ("app_rows", _order("j1", 2)),
    "a stale owner's order beside the accepted one": ("app_rows", _order("j1", 1)),
    "an order on a dead key (models committed without the finish)": ("app_rows",
                                                                     _order("j3", 1)),
    "an order of a stale owner's token": ("stale_app_row", _stale_order),
    "an accepted result of another token than the order": ("stale_app_row", _stale_result),
    "an order without its payment": ("order_payment", _payments("j1", [])),
    "an order with two payments": ("order_payment", _payments("j1", [2, 2])),
    "a payment of another token than its order": ("order_payment", _payments("j2", [2])),
}


def test_a_clean_django_history_passes() -> None:
    report = check(django_history())
    assert report.passed, report.violations
    assert report.counts["app rows"] == 2
    assert report.counts["payments"] == 2
    assert report.counts["order_payment"] == 0


@pytest.mark.parametrize("defect", DEFECTS)
def test_each_django_check_fails_on_its_defect(defect: str) -> None:
    name, doctor = DEFECTS[defect]
    history = copy.deepcopy(django_history())
    doctor(history)
    assert name in check(history).failed_checks(), (defect, check(history).violations)


def test_every_check_of_the_django_variant_has_a_defect_that_fails_it() -> None:
    assert {name for name, _ in DEFECTS.values()} == set(VARIANT_CHECKS[DJANGO_VARIANT])


def test_each_variant_is_judged_and_shown_by_its_own_checks_only() -> None:
    """An ``enqueue-tx`` history has no payments: ``order_payment`` is neither run nor shown
    there, and the Django run shows none of the publishers' checks."""
    assert "order_payment" not in check(tx_history()).counts
    shown = check(django_history()).counts
    assert "rolled_back_ran" not in shown and "order_mismatch" not in shown


def test_the_django_variants_all_holds_the_commit_fault() -> None:
    kinds, _ = parse_faults("all", "postgres", DJANGO_VARIANT)
    assert {"kill", "stop", "conn", "slow", "sweep", "finish", "hold", "commit"} == set(kinds)
    with pytest.raises(ValueError, match="publisher"):
        parse_faults("kill,publisher", "postgres", DJANGO_VARIANT)
