"""Celery's integration tests, from the source distribution of the installed release.

The tests that ship with Celery are not in its wheel: they come from its sdist on the package
index (``pip download --no-binary :all: --no-deps celery==VERSION``), downloaded once into a
cache folder and unpacked per run. Only what the integration tests need is unpacked:
``t/integration/``, the modules of ``t/`` they import (``t/*.py``) and ``pyproject.toml``,
whose ``[tool.pytest.ini_options]`` makes Celery's classes (``test_chord``) collected and
its strict markers and strict xfails apply.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

__all__ = ["default_cache", "extract_tests", "fetch_sdist"]

#: How long ``pip download`` may take (the sdist is about 2 MB).
DOWNLOAD_TIMEOUT = 300.0


def default_cache() -> Path:
    """``$XDG_CACHE_HOME/lease_celery/celery-compat`` (``~/.cache/...`` without it)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lease_celery" / "celery-compat"


def fetch_sdist(version: str, *, cache: Path) -> Path:
    """The path of ``celery-VERSION.tar.gz`` in ``cache``, downloaded with pip the first time.

    The download goes to a temporary folder inside ``cache`` and is moved into place whole,
    so two runs downloading at once never see half a file. ``SystemExit`` naming the problem
    when pip cannot get it (no such release, the index unreachable).
    """
    target = cache / f"celery-{version}.tar.gz"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix="download-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:",
                   "--no-deps", "--disable-pip-version-check", f"celery=={version}", "-d", tmp]
        try:
            run = subprocess.run(command, capture_output=True, text=True,
                                 timeout=DOWNLOAD_TIMEOUT, check=False)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"celery_compat: `pip download celery=={version}` (the sdist) took "
                             f"longer than {DOWNLOAD_TIMEOUT:g} s") from None
        found = sorted(Path(tmp).glob("celery-*.tar.gz"))
        if run.returncode != 0 or not found:
            detail = (run.stderr or run.stdout).strip().splitlines()[-5:]
            raise SystemExit(f"celery_compat: could not download Celery {version}'s source "
                             f"distribution with `{' '.join(command[2:])}` (exit "
                             f"{run.returncode}):\n  " + "\n  ".join(detail or ["no output"]))
        shutil.move(str(found[0]), target)
    return target


def _wanted(relative: str) -> bool:
    """Whether an sdist member (its path below ``celery-VERSION/``) is needed by the tests."""
    parts = relative.split("/")
    if parts == ["pyproject.toml"]:
        return True
    if parts[0] != "t" or len(parts) < 2:
        return False
    if len(parts) == 2:  # t/__init__.py, t/canvas_helpers.py, t/skip.py: what they import
        return parts[1].endswith(".py")
    return parts[1] == "integration"


def extract_tests(sdist: Path, *, into: Path) -> Path:
    """Unpack the integration tests of ``sdist`` into ``into`` (created); returns ``into``,
    the folder to run pytest from. ``SystemExit`` when the archive has no
    ``t/integration/conftest.py``."""
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as archive:
        members = []
        for member in archive.getmembers():
            _, _, relative = member.name.partition("/")
            if relative and _wanted(relative):
                member.name = relative
                members.append(member)
        archive.extractall(into, members=members, filter="data")
    if not (into / "t" / "integration" / "conftest.py").is_file():
        raise SystemExit(f"celery_compat: {sdist} has no t/integration/conftest.py: not a Celery "
                         "source distribution with its integration tests")
    return into
