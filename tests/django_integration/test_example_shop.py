"""The Django example runs with one command: ``python -m examples.django_shop`` sets the
project up on SQLite and plays its story with real workers; every order is paid once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.workers import REPO


def test_the_shop_story_pays_every_order_once(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "examples.django_shop", "--no-admin",
                           "--data-dir", str(tmp_path / "shop")],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Every order was paid exactly once." in done.stdout
    assert "refused: LeaseLost" in done.stdout  # the stalled worker's late payment
    assert "taken_over" in done.stdout
