"""The documentation's Python examples run as written, and the README stays a front page.

The convention (also on the proof page, docs/proof.md "The examples on these pages"):

- the ```python blocks of one page run top to bottom in one namespace, in a temporary
  directory that is on ``sys.path``;
- a block whose first line is a file name comment (``# proj/tasks.py``) is written to that
  file instead, for later blocks to import;
- ``test_*`` functions the blocks define are then called, with the ``lease_store`` and
  ``lease_clock`` fixtures of the package when they name them;
- a block right after the line ``<!-- docs-example: skip -->`` is not run (kept rare).

The README's quickstart needs a worker and Redis: tests/workers/test_readme.py runs it.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import _state as celery_state

from lease_celery.testing import ManualClock, scratch_store

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
SKIP = "<!-- docs-example: skip -->"
#: A ```python block at the start of a line, with the line before it (for the skip marker).
BLOCK = re.compile(r"(?:^|\n)(?P<before>[^\n]*)\n```python\n(?P<code>.*?)\n```", re.DOTALL)
FILE_COMMENT = re.compile(r"# (?P<path>[\w./-]+\.py)$")


def python_blocks(page: Path) -> list[tuple[str, bool]]:
    """(code, skipped) of every ```python block of ``page``, in order."""
    text = "\n" + page.read_text()
    return [(m["code"] + "\n", m["before"].strip() == SKIP) for m in BLOCK.finditer(text)]


def _fixtures() -> Iterator[dict[str, Any]]:
    clock = ManualClock()
    with scratch_store(clock=clock) as store:
        yield {"lease_clock": clock, "lease_store": store}


def run_page(page: Path, workdir: Path) -> int:
    """Run ``page``'s examples in ``workdir``; return how many blocks ran (files included)."""
    namespace: dict[str, Any] = {"__name__": f"docs_example_{page.stem.replace('-', '_')}"}
    ran = 0
    for index, (code, skipped) in enumerate(python_blocks(page)):
        if skipped:
            continue
        first = code.splitlines()[0] if code.strip() else ""
        named = FILE_COMMENT.fullmatch(first)
        if named:
            target = workdir / named["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(code)
        else:
            compiled = compile(code, f"{page.relative_to(REPO)} (python block {index + 1})",
                               "exec")
            exec(compiled, namespace)
        ran += 1
    tests = [value for name, value in list(namespace.items())
             if name.startswith("test_") and inspect.isfunction(value)]
    for test in tests:
        wanted = inspect.signature(test).parameters
        fixtures = _fixtures()
        provided = next(fixtures)
        try:
            test(**{name: provided[name] for name in wanted})
        finally:
            fixtures.close()
    return ran


def _signals() -> list[Any]:
    """Every signal of Celery's and lease_celery's an example may connect a receiver to."""
    import celery.signals
    from celery.utils.dispatch import Signal

    from lease_celery import signals

    return [value for module in (celery.signals, signals) for value in vars(module).values()
            if isinstance(value, Signal)]


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A working directory on sys.path; the modules imported from it, the receivers an example
    connected and a global instrumentation it switched on are gone afterwards.

    lease_celery's own receivers are connected first: the first LeasedTask an example binds
    would connect them once per process, and taking them away with the example's would leave
    the rest of this process unwired (no metrics, no history) for good."""
    from lease_celery import wiring

    wiring.install()
    # An example's @shared_task (or app.task, shared by default) stays in Celery's list of
    # tasks every app finalized later gets: a doctor test after it saw docs_example_* tasks.
    finalizers = set(celery_state._on_app_finalizers)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    signals = _signals()
    receivers = {signal: list(signal.receivers) for signal in signals}
    try:
        yield tmp_path
    finally:
        celery_state._on_app_finalizers.intersection_update(finalizers)
        for signal in signals:  # receivers an example connected (weak=False ones included)
            signal.receivers[:] = receivers[signal]
            signal.sender_receivers_cache.clear()
        for name in set(sys.modules) - before:
            path = getattr(sys.modules[name], "__file__", None) or ""
            spec_path = list(getattr(sys.modules[name], "__path__", []) or [])
            if str(tmp_path) in path or any(str(tmp_path) in p for p in spec_path):
                del sys.modules[name]
        otel = sys.modules.get("lease_celery.otel")
        if otel is not None and otel.is_instrumented():
            otel.uninstrument()


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_the_pages_python_examples_run(page: Path, sandbox: Path) -> None:
    """Every runnable ```python block of the page runs as written, and the tests it defines
    pass."""
    run_page(page, sandbox)


def test_the_examples_leave_lease_celery_wired_and_their_tasks_behind() -> None:
    """After the pages ran (the tests above, in this process), lease_celery's receivers are
    still connected (a leased run here is counted by metrics), and an app made now has none
    of the examples' tasks."""
    from celery import Celery

    from lease_celery import LeasedTask, metrics
    from lease_celery.testing import scratch_leases

    app = Celery("docs-wired", broker="memory://", set_as_current=False)

    @app.task(base=LeasedTask, lease_key="wired:{n}", shared=False)
    def wired(n: int) -> int:
        return n

    with scratch_leases(app):
        before = metrics.snapshot()["totals"]["claims"]
        assert wired.apply((1,)).get() == 1
        assert metrics.snapshot()["totals"]["claims"] == before + 1
    app.finalize()
    assert [name for name in app.tasks if name.startswith("docs_example")] == []


def test_examples_run_on_most_pages_and_skips_are_rare() -> None:
    """The examples are code that runs: most guide pages have some, and at most two blocks in
    the whole site are skipped."""
    blocks = {page: python_blocks(page) for page in PAGES}
    skipped = [page.name for page, found in blocks.items() for _, skip in found if skip]
    assert len(skipped) <= 2, skipped
    with_examples = [page.name for page, found in blocks.items() if found]
    assert len(with_examples) >= 8, with_examples
    assert sum(len(found) for found in blocks.values()) >= 15


def test_the_readme_is_a_front_page() -> None:
    """At most about two screens; it says how to install, what it supports, how it compares,
    and every documentation link it has goes to a page that exists."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    first_screen = "\n".join(readme.splitlines()[:60])
    for needed in ("pip install 'lease-celery[redis]'", "pip install 'lease-celery[postgres]'",
                   "Celery 5.7", "kombu 5.7", "Python 3.11", "celery-once", "celery-singleton",
                   "acks_late"):
        assert needed in first_screen, needed
    links = re.findall(r"\]\(((?:docs/|CHANGELOG|CONTRIBUTING)[^)#]*)(?:#[^)]*)?\)", readme)
    assert len(links) >= 12, links
    missing = [link for link in links if not (REPO / link).is_file()]
    assert missing == []
    linked = {REPO / link for link in links}
    guide = [p for p in PAGES if p.parent == DOCS and p.name not in ("index.md", "changelog.md")]
    assert [p.name for p in guide if p not in linked] == []


def test_the_docs_tools_are_one_group_and_ci_builds_strictly() -> None:
    """pyproject.toml's ``docs`` dependency group has the site's tools, and .ci/run installs
    it and builds the site with --strict outside the repository."""
    import tomllib

    groups = tomllib.loads((REPO / "pyproject.toml").read_text())["dependency-groups"]
    names = {re.split(r"[<>=\[ ;]", spec, maxsplit=1)[0] for spec in groups["docs"]}
    assert {"mkdocs-material", "mkdocstrings-python", "mkdocs-click"} <= names
    ci = (REPO / ".ci" / "run").read_text()
    assert "--group test --group docs" in ci
    assert re.search(r"^(NO_MKDOCS_2_WARNING=1 )?\.venv/bin/mkdocs build --strict "
                     r"--site-dir \"\$\{TMPDIR", ci, re.M)
    assert os.path.isfile(REPO / "mkdocs.yml")


def test_every_dependency_group_install_upgrades_pip_first() -> None:
    """``pip install … --group G`` needs pip 25.1 or later, and a fresh venv of Python 3.11
    bundles pip 23.2 ("no such option: --group"): every such command the README and the docs
    give a reader upgrades pip in the same command, before it."""
    pages = [REPO / "README.md", REPO / "CONTRIBUTING.md", *PAGES]
    found = []
    for page in pages:
        for line in page.read_text().splitlines():
            for command in re.findall(r"[^`\n]*pip install [^`\n]*--group[^`\n]*", line):
                found.append(command)
                assert re.search(r"pip install (-q )?(-U|--upgrade) pip\b.*&&.*--group",
                                 command), f"{page.name}: {command}"
    assert found, "no dependency group install found: the test would check nothing"


def test_every_page_is_in_the_navigation() -> None:
    """Every page of docs/ is reachable from the site's navigation (mkdocs.yml ``nav``): a
    page left out is built but found only by a reader who already has its address."""
    config = (REPO / "mkdocs.yml").read_text()
    nav = config[config.index("\nnav:"):]
    listed = set(re.findall(r"^\s+- (?:[^:\n]+: )?([\w./-]+\.md)$", nav, re.MULTILINE))
    pages = {str(page.relative_to(DOCS)) for page in PAGES}
    assert pages - listed == set(), "add these pages to mkdocs.yml's nav"
    assert "porting.md" in listed
