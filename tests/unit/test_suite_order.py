"""The parallel tier's order (tests/conftest.py ``HEAVIEST_FIRST``) names real files, and
.ci/run keeps it (xdist would otherwise reorder the files by their number of tests)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import HEAVIEST_FIRST

TESTS = Path(__file__).resolve().parents[1]


def test_every_heaviest_file_exists() -> None:
    missing = [name for name in HEAVIEST_FIRST if not (TESTS / name).is_file()]
    assert missing == [], f"tests/conftest.py HEAVIEST_FIRST names no such file: {missing}"
    assert len(set(HEAVIEST_FIRST)) == len(HEAVIEST_FIRST)


def test_ci_runs_the_parallel_tier_in_that_order() -> None:
    ci = (TESTS.parent / ".ci" / "run").read_text()
    parallel = next(line for line in ci.splitlines()
                    if line.startswith(".venv/bin/python -m pytest -n "))
    assert "--dist loadfile" in parallel and "--no-loadscope-reorder" in parallel, parallel
