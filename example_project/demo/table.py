"""The side-by-side table the demo ends with, and its machine-readable twin."""

from __future__ import annotations

from .tally import ROWS, Tally

__all__ = ["render"]

#: Extra rows that explain the main ones: (attribute, label).
DETAILS = [
    ("deferred", "  deliveries deferred by a live lease"),
    ("ignored", "  deliveries dropped: report already done"),
    ("deliveries_killed", "  deliveries cut short by the SIGKILL"),
    ("swept", "  re-published by a sweeper (lease expired)"),
    ("broker_redeliveries", "  redeliveries made by the broker itself"),
]


def render(tallies: list[Tally]) -> str:
    label_width = max(len(label) for _, label, _ in ROWS + [(a, b, "") for a, b in DETAILS])
    width = max(14, *(len(t.title) for t in tallies))
    lines = [" " * label_width + "".join(f"  {t.title:>{width}}" for t in tallies)]
    for attribute, label, _ in ROWS:
        lines.append(f"{label:<{label_width}}"
                     + "".join(f"  {getattr(t, attribute):>{width}}" for t in tallies))
    for attribute, label in DETAILS:
        lines.append(f"{label:<{label_width}}"
                     + "".join(f"  {getattr(t, attribute):>{width}}" for t in tallies))
    lines.append("")
    lines.extend(f"{label}: {source}" for _, label, source in ROWS[2:])
    return "\n".join(lines)
