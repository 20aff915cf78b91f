"""The benchmark stays runnable: a very short run prints a row per store with a ratio.

Speed goals are not asserted here (machines are noisy); this only keeps the script from
rotting when the stores' statements change.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.servers import postgres_reachable, redis_reachable, require

REPO = Path(__file__).resolve().parent.parent


def test_store_cycle_benchmark_runs_on_every_store() -> None:
    """``benchmarks/store_cycle.py`` with tiny bursts prints cycles/s and a ratio per store."""
    for name, (reachable, detail) in (("PostgreSQL", postgres_reachable()),
                                      ("Redis", redis_reachable())):
        require(name, reachable, detail)
    run = subprocess.run([sys.executable, "benchmarks/store_cycle.py", "--seconds", "0.05",
                          "--rounds", "2"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(
        r"^(sqlite|postgres|redis)\s+[\d,]+\s+[\d,]+\s+([\d.]+)$", run.stdout, re.MULTILINE)}
    assert set(rows) == {"sqlite", "postgres", "redis"}, run.stdout
    assert all(ratio > 0 for ratio in rows.values())

