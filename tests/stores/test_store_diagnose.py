"""Each store diagnoses itself (``Store.diagnose``): doctor prints what the store says,
with no branch on a store's scheme, so a store added later brings its own checks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from celery import Celery

from lease_celery import LeasedTask, Store, open_store
from lease_celery.doctor import diagnose
from lease_celery.errors import LeaseError
from lease_celery.models import Finding
from lease_celery.stores.sqlite import SQLiteStore
from lease_celery.testing import ManualClock

DOCTOR = Path(__file__).resolve().parents[2] / "lease_celery" / "doctor.py"


def test_doctor_has_no_branch_on_a_stores_scheme() -> None:
    """doctor.py names no store scheme and imports no backend: the stores' checks are
    theirs (the broker's scheme it still reads: the broker is not a store)."""
    source = DOCTOR.read_text()
    strings = {node.value for node in ast.walk(ast.parse(source))
               if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert not {s for s in strings if s in ("sqlite", "postgresql", "postgres", "rediss")}
    imported = {node.module for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.ImportFrom) and node.module}
    assert not {m for m in imported if m.startswith(("stores.sqlite", "stores.postgres",
                                                     "stores.redis"))}
    assert "import redis" not in source and "import sqlite3" not in source


def test_doctor_prints_what_the_store_says(sqlite_url: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a store's diagnose returns is a finding of doctor's, as it is."""
    said = Finding("store.example", "warning", "ownership", "the store's own words")
    monkeypatch.setattr(SQLiteStore, "_diagnose", lambda self: [said])
    app = Celery("said", broker="memory://", set_as_current=False)
    app.conf.lease_store_url = sqlite_url

    @app.task(base=LeasedTask, shared=False)
    def job() -> None: ...

    assert said in diagnose(app)


def test_a_sound_store_says_nothing_to_worry_about(store_url: str) -> None:
    """On the suite's servers (a local file; PostgreSQL; a Redis the fixture keeps durable
    enough for the check or not): no error, and the clock agrees with this host's."""
    with open_store(store_url) as store:
        found = store.diagnose()
    assert not [f for f in found if f.severity == "error"], found
    assert "store.clock" not in {f.code for f in found}


def test_a_store_whose_clock_is_off_says_so(stores: list[Store], clock: ManualClock) -> None:
    """A store whose clock is far from this host's (here a clock at epoch 100 s) warns: the
    leases hold on its clock, the history's times do not line up."""
    found = {f.code: f for f in stores[0].diagnose()}
    assert found["store.clock"].severity == "warning"
    assert "behind this host's" in found["store.clock"].message


def test_an_unusable_store_raises_its_error() -> None:
    """diagnose reads first: a store that cannot be used raises (doctor: store.unreachable)."""
    with open_store("postgresql://127.0.0.1:1/test?connect_timeout=2") as store, \
            pytest.raises(LeaseError, match=r"127\.0\.0\.1"):
        store.diagnose()
