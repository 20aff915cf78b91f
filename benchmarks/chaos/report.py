"""The printed verdict: one table of numbers, then the violations (a few per check)."""

from __future__ import annotations

from collections import defaultdict

from .checker import CHECKS, Report, Violation

__all__ = ["format_report"]

#: Violations printed per check (all of them are in the run's report.txt).
SHOWN = 8


def format_report(report: Report, *, shown: int = SHOWN) -> str:
    width = max(len(name) for name in report.counts) if report.counts else 10
    lines = [f"chaos run on {report.store}: {'PASSED' if report.passed else 'FAILED'}", ""]
    lines.append(f"| {'metric'.ljust(width)} | value")
    lines.append(f"| {'-' * width} | -----")
    for name, value in report.counts.items():
        mark = "  FAIL" if name in CHECKS and value else ""
        lines.append(f"| {name.ljust(width)} | {value}{mark}")
    for note in report.notes:
        lines.append(f"note: {note}")
    by_check: dict[str, list[Violation]] = defaultdict(list)
    for violation in report.violations:
        by_check[violation.check].append(violation)
    for name, violations in by_check.items():
        lines += ["", f"{name} ({CHECKS[name]}): {len(violations)}"]
        lines += [f"  {v.subject}: {v.detail}" for v in violations[:shown]]
        if len(violations) > shown:
            lines.append(f"  … and {len(violations) - shown} more")
    return "\n".join(lines)
