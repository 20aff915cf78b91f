"""The chaos harness's transactional variants (``--variant app-tx``, ``enqueue-tx``,
``django-tx``): their checks can fail, and a short run of each passes on SQLite and PostgreSQL
(``django-tx``'s in tests/django_integration/test_chaos_run.py, where Django is installed).

The doctored histories are test_chaos.py's clean one, told as an ``enqueue-tx`` run: each done
job has its one app row and its order; the dead one (j3) has its order (it committed, its job
then died) and no app row; and one order (j4) was rolled back and left nothing. And told as
a ``django-tx`` run: each done job has its one Django order, of the key's final token, with
its one payment of the same token; the dead job has none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from benchmarks.chaos.checker import check
from benchmarks.chaos.config import DJANGO_VARIANT, JOB_TASK
from benchmarks.chaos.faults import parse_faults
from benchmarks.chaos.history import History, Row
from benchmarks.chaos.txchecks import VARIANT_CHECKS
from tests.support.chaos import run_chaos
from tests.support.servers import postgres_reachable, redis_reachable, require
from tests.workers.test_chaos import A, C, D, clean_history

ROLLED_BACK = "id-r"


def _event(event: str, t: float, pid: int, **fields: Any) -> dict[str, Any]:
    return {"event": event, "t": t, "pid": pid, **fields}


def tx_history() -> History:
    history = clean_history()
    history.variant = "enqueue-tx"
    history.rows["job:j1"] = Row("job:j1", "done", 2, "w:21:x", None, 2, 1, {"token": 2})
    history.rows["job:j2"] = Row("job:j2", "done", 1, "w:12:x", None, 1, 0, {"token": 1})
    history.app_rows = {"j1": [{"token": 2, "pid": 21, "task_id": A}],
                        "j2": [{"token": 1, "pid": 12, "task_id": C}]}
    history.orders = {"j1": A, "j2": C, "j3": D}
    history.events += [
        _event("order", 0.5, 90, slot=0, job="j1", task_id=A, outcome="committed"),
        _event("order", 0.6, 90, slot=0, job="j4", task_id=ROLLED_BACK, outcome="rolled_back"),
    ]
    return history


def django_history() -> History:
    history = clean_history()
    history.variant = DJANGO_VARIANT
    history.rows["job:j1"] = Row("job:j1", "done", 2, "w:21:x", None, 2, 1, {"token": 2})
    history.rows["job:j2"] = Row("job:j2", "done", 1, "w:12:x", None, 1, 0, {"token": 1})
    history.app_rows = {"j1": [{"token": 2, "pid": 21, "task_id": A, "payments": [2]}],
                        "j2": [{"token": 1, "pid": 12, "task_id": C, "payments": [1]}]}
    return history


#: Each variant's doctored history (app-tx's checks are enqueue-tx's first two).
HISTORIES: dict[str, Callable[[], History]] = {"enqueue-tx": tx_history,
                                               DJANGO_VARIANT: django_history}


def _app_row(job: str, token: int) -> Callable[[History], None]:
    return lambda h: h.app_rows.setdefault(job, []).append({"token": token, "pid": 1})


def _no_app_row(h: History) -> None:
    del h.app_rows["j2"]


def _stale_app_row(h: History) -> None:
    h.app_rows["j1"] = [{"token": 1, "pid": 11}]


def _stale_result(h: History) -> None:
    h.rows["job:j1"] = Row("job:j1", "done", 2, "w:21:x", None, 2, 1, {"token": 1})


def _rolled_back_started(h: History) -> None:
    h.events.append(_event("body_start", 3.0, 21, task=JOB_TASK, task_id=ROLLED_BACK,
                           key="job:j4", token=1))


def _rolled_back_received(h: History) -> None:
    h.received.append({"idempotency_key": "send:j4", "token": 1, "pid": 21})


def _rolled_back_row(h: History) -> None:
    h.rows["job:j4"] = Row("job:j4", "ready", 0)


def _order_without_row(h: History) -> None:
    h.orders["j5"] = "id-5"


def _row_without_order(h: History) -> None:
    del h.orders["j2"]


def _django_order(job: str, token: int) -> Callable[[History], None]:
    return lambda h: h.app_rows.setdefault(job, []).append(
        {"token": token, "pid": 1, "task_id": "x", "payments": [token]})


def _stale_django_order(h: History) -> None:
    h.app_rows["j1"] = [{"token": 1, "pid": 11, "task_id": A, "payments": [1]}]


def _payments(job: str, payments: list[int]) -> Callable[[History], None]:
    def doctor(h: History) -> None:
        h.app_rows[job][0]["payments"] = payments
    return doctor


DEFECTS: dict[str, tuple[str, str, Callable[[History], None]]] = {
    "a done key without its app row": ("enqueue-tx", "app_rows", _no_app_row),
    "two app rows for one key": ("enqueue-tx", "app_rows", _app_row("j1", 1)),
    "an app row on a dead key": ("enqueue-tx", "app_rows", _app_row("j3", 1)),
    "a stale owner's app row": ("enqueue-tx", "stale_app_row", _stale_app_row),
    "an accepted result of another token": ("enqueue-tx", "stale_app_row", _stale_result),
    "a rolled-back job started": ("enqueue-tx", "rolled_back_ran", _rolled_back_started),
    "a rolled-back job's effect": ("enqueue-tx", "rolled_back_ran", _rolled_back_received),
    "a rolled-back job's lease row": ("enqueue-tx", "rolled_back_ran", _rolled_back_row),
    "an order without its lease row": ("enqueue-tx", "order_mismatch", _order_without_row),
    "a lease row without its order": ("enqueue-tx", "order_mismatch", _row_without_order),
    # django-tx: its app rows are the Django orders, each with its payments' tokens.
    "django: a done key without its order": (DJANGO_VARIANT, "app_rows", _no_app_row),
    "django: two orders of the final token (a block committed twice)": (
        DJANGO_VARIANT, "app_rows", _django_order("j1", 2)),
    "django: a stale owner's order beside the accepted one": (
        DJANGO_VARIANT, "app_rows", _django_order("j1", 1)),
    "django: an order on a dead key (models committed without the finish)": (
        DJANGO_VARIANT, "app_rows", _django_order("j3", 1)),
    "django: an order of a stale owner's token": (DJANGO_VARIANT, "stale_app_row",
                                                  _stale_django_order),
    "django: an accepted result of another token than the order": (
        DJANGO_VARIANT, "stale_app_row", _stale_result),
    "django: an order without its payment": (DJANGO_VARIANT, "order_payment",
                                             _payments("j1", [])),
    "django: an order with two payments": (DJANGO_VARIANT, "order_payment",
                                           _payments("j1", [2, 2])),
    "django: a payment of another token than its order": (DJANGO_VARIANT, "order_payment",
                                                          _payments("j2", [2])),
}


@pytest.mark.parametrize("variant", HISTORIES)
def test_a_clean_transactional_history_passes(variant: str) -> None:
    report = check(HISTORIES[variant]())
    assert report.passed, report.violations
    assert report.counts["app rows"] == 2
    assert report.counts["app_rows"] == 0


def test_the_django_variant_counts_the_payments() -> None:
    assert check(django_history()).counts["payments"] == 2


@pytest.mark.parametrize("defect", DEFECTS)
def test_each_transactional_check_fails_on_its_defect(defect: str) -> None:
    variant, name, doctor = DEFECTS[defect]
    history = HISTORIES[variant]()
    doctor(history)
    assert name in check(history).failed_checks(), (defect, check(history).violations)


def test_every_check_of_each_variant_has_a_defect_that_fails_it() -> None:
    for variant in HISTORIES:
        assert ({name for where, name, _ in DEFECTS.values() if where == variant}
                == set(VARIANT_CHECKS[variant])), variant
    assert set(VARIANT_CHECKS["app-tx"]) <= set(VARIANT_CHECKS["enqueue-tx"])


def test_each_variant_is_judged_and_shown_by_its_own_checks_only() -> None:
    """An ``enqueue-tx`` history has no payments: ``order_payment`` is neither run nor shown
    there, and the Django run shows none of the publishers' checks."""
    assert "order_payment" not in check(tx_history()).counts
    shown = check(django_history()).counts
    assert "rolled_back_ran" not in shown and "order_mismatch" not in shown


def test_a_plain_run_is_not_judged_by_the_app_tables() -> None:
    """No app table in a plain run: its keys have no app rows, and nothing fails for it."""
    report = check(clean_history())
    assert report.passed, report.violations
    assert "app_rows" not in report.counts


def test_a_variants_all_holds_its_own_faults() -> None:
    """``all`` takes each variant's own faults along (and leaves the server faults out on
    SQLite); a variant's fault named in another variant is unknown there."""
    kinds, _ = parse_faults("all", "sqlite", "enqueue-tx")
    assert {"commit", "publisher", "purge", "kill"} <= set(kinds)
    assert "conn" not in kinds
    assert "commit" in parse_faults("all", "postgres", "app-tx")[0]
    assert "publisher" not in parse_faults("all", "postgres", "app-tx")[0]
    with pytest.raises(ValueError, match="purge"):
        parse_faults("kill,purge", "postgres", "app-tx")
    assert "commit" not in parse_faults("all", "postgres")[0]
    assert ({"kill", "stop", "conn", "slow", "sweep", "finish", "hold", "commit"}
            == set(parse_faults("all", "postgres", DJANGO_VARIANT)[0]))
    with pytest.raises(ValueError, match="publisher"):
        parse_faults("kill,publisher", "postgres", DJANGO_VARIANT)


# -- the runs ----------------------------------------------------------------------------------

RUN_TIMEOUT = 150


@pytest.mark.worker
@pytest.mark.serial  # its 2 s ttl: a second test process starving this one fails a lease
@pytest.mark.timeout(RUN_TIMEOUT + 60)
# One run here in CI (the serial tier is the suite's long pole): the enqueue on SQLite, whose
# jobs complete as app-tx's do. The completion in the app's transaction on PostgreSQL, under
# connection kills and slow replies too, is the django-tx short run's
# (tests/django_integration/test_chaos_run.py: the same retry loop, apptx.commit_retrying,
# through Django's connection). The full runs of every variant and store are commands with
# their figures in docs/proof.md (`python -m benchmarks.chaos --store postgres --variant
# app-tx`).
@pytest.mark.parametrize(("variant", "store"), [("enqueue-tx", "sqlite")])
def test_a_short_transactional_chaos_run_passes(variant: str, store: str) -> None:
    """100 jobs over 10 s with every fault that applies to the store and the variant: kills
    (of workers, of pool children right after their app transaction committed, of publishers
    right after theirs), stalls, connection kills and slow replies (PostgreSQL), sweeps, and
    for ``enqueue-tx`` two queue purges. The checker passes: one app row per done key, no
    rolled-back job ran."""
    reachable, detail = redis_reachable()
    require("Redis", reachable, detail)
    if store == "postgres":
        reachable, detail = postgres_reachable()
        require("PostgreSQL", reachable, detail)
    run_chaos(["--store", store, "--variant", variant, "--tasks", "100", "--seconds", "10",
               "--faults", "all", "--settle", "45"],
              timeout=RUN_TIMEOUT, what=f"the {variant} run on {store}")
