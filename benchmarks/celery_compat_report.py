"""Reading the two runs' JUnit XML files and comparing them, test by test.

A test's outcome is ``passed``, ``failed`` (a failure or an error, in any phase: an error in
teardown after a passing call counts as failed), or ``skipped`` (skips and expected
failures). A test that reported more than once (subtests, reruns) takes its worst outcome.
Tests are named ``test_canvas.py::test_chord::test_x[param]``.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Comparison", "Outcome", "compare", "read_junit"]

_RANK = {"passed": 0, "skipped": 1, "failed": 2}


@dataclass(frozen=True)
class Outcome:
    """One test's outcome in one run, and the first line of its failure (failed only)."""

    status: str
    message: str = ""


def _name(case: ET.Element) -> str:
    """``test_canvas.py::test_chord::test_x`` from JUnit's classname and name."""
    parts = case.get("classname", "").split(".")  # t.integration.test_canvas.test_chord
    module = next((i for i, part in enumerate(parts) if part.startswith("test_")), None)
    where = [] if module is None else [f"{parts[module]}.py", *parts[module + 1:]]
    return "::".join([*where, case.get("name", "")])


def _first_line(element: ET.Element) -> str:
    text = element.get("message") or element.text or element.tag
    return next((line.strip() for line in text.splitlines() if line.strip()), element.tag)


def _outcome(case: ET.Element) -> Outcome:
    for tag in ("failure", "error"):
        found = case.find(tag)
        if found is not None:
            return Outcome("failed", _first_line(found))
    if case.find("skipped") is not None:
        return Outcome("skipped")
    return Outcome("passed")


def read_junit(path: Path) -> dict[str, Outcome]:
    """Every test case of the JUnit XML file at ``path``, by name, at its worst outcome."""
    outcomes: dict[str, Outcome] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name, outcome = _name(case), _outcome(case)
        seen = outcomes.get(name)
        if seen is None or _RANK[outcome.status] > _RANK[seen.status]:
            outcomes[name] = outcome
    return outcomes


def _counts(outcomes: dict[str, Outcome]) -> dict[str, int]:
    counts = dict.fromkeys(_RANK, 0)
    for outcome in outcomes.values():
        counts[outcome.status] += 1
    return {"tests": len(outcomes), **counts}


@dataclass
class Comparison:
    """The two runs side by side."""

    plain: dict[str, Outcome]
    leased: dict[str, Outcome]
    #: Pass plain, fail leased: name -> the first line of the leased failure.
    regressions: dict[str, str] = field(default_factory=dict)
    #: Fail in both: name -> the first line of the leased failure.
    both_fail: dict[str, str] = field(default_factory=dict)
    #: Fail plain, pass leased.
    leased_only_pass: list[str] = field(default_factory=list)
    #: Ran in one run and not in the other (a run cut short, a skip in one mode only).
    unmatched: dict[str, str] = field(default_factory=dict)

    def counts(self) -> dict[str, dict[str, int]]:
        return {"plain": _counts(self.plain), "leased": _counts(self.leased)}

    def as_json(self) -> dict[str, Any]:
        return {"counts": self.counts(), "pass_plain_fail_leased": self.regressions,
                "fail_both": self.both_fail, "fail_plain_pass_leased": self.leased_only_pass,
                "unmatched": self.unmatched}


def compare(plain: dict[str, Outcome], leased: dict[str, Outcome]) -> Comparison:
    """The tests whose outcome differs between the runs, and those failing in both."""
    result = Comparison(plain, leased)
    for name in sorted(plain.keys() | leased.keys()):
        before, after = plain.get(name), leased.get(name)
        if before is None or after is None:
            ran = "plain" if after is None else "leased"
            result.unmatched[name] = f"only in the {ran} run"
        elif before.status == "passed" and after.status == "failed":
            result.regressions[name] = after.message
        elif before.status == "failed" and after.status == "failed":
            result.both_fail[name] = after.message
        elif before.status == "failed" and after.status == "passed":
            result.leased_only_pass.append(name)
        elif before.status != after.status:
            result.unmatched[name] = f"{before.status} plain, {after.status} leased"
    return result
