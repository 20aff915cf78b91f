"""One key's history as an inline SVG timeline, in the style of the demo's picture.

One lane per lease generation (token), a bar from its claim to the event that ended it,
coloured by owner; marks for what happened on the way (✓ finished, ⊘ stale result refused,
✕ dead, ⟳ swept, ↩ released, ↻ retry, ◆ cancel requested, ▲ an operator's action). Events
that belong to no generation get a lane of their own on top. Hovering any mark shows its
details (SVG ``<title>``). No scripts; every text is escaped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from ..models import HistoryEntry, LeaseRecord, LeaseState
from .html import Safe, ago, h, utc

__all__ = ["timeline_svg"]

WIDTH = 960
LEFT = 150
RIGHT = 90
LANE = 26
BAR = 14
OWNER_COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948"]
GOOD, BAD, MUTED, INK = "#2e7d32", "#c62828", "#8a8a8a", "#222222"

#: event -> (symbol, colour, label drawn beside it or "")
MARKS: dict[str, tuple[str, str, str]] = {
    "finished": ("✓", GOOD, ""),
    "stale_refused": ("⊘", BAD, "stale: refused"),
    "dead": ("✕", BAD, "dead"),
    "swept": ("⟳", GOOD, "swept"),
    "released": ("↩", MUTED, "released"),
    "retry": ("↻", MUTED, "retry"),
    "lapsed": ("┤", INK, "lapsed"),
    "cancel_requested": ("◆", BAD, "cancel"),
    "answered": ("●", MUTED, ""),
}
_STARTS = ("claimed", "taken_over")
_ENDS = ("finished", "lapsed", "released", "retry", "dead")
#: Time (epoch seconds) -> x (pixels).
_X = Callable[[float], float]
_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 21600, 43200,
          86400, 172800, 604800]


def timeline_svg(entries: Sequence[HistoryEntry], *, record: LeaseRecord | None,
                 now: float) -> Safe:
    """The SVG for ``entries`` (oldest first); an empty history draws nothing."""
    if not entries:
        return Safe("")
    tokens = list(dict.fromkeys(e.token for e in entries if e.token is not None))
    loose = [e for e in entries if e.token is None]
    lanes: list[int | None] = [None] if loose else []
    lanes += tokens
    origin = entries[0].at
    live = record is not None and record.state is LeaseState.RUNNING
    end = max(entries[-1].at, now if live else entries[-1].at)
    span = max(end - origin, 1.0)
    scale = (WIDTH - LEFT - RIGHT) / span

    def x(at: float) -> float:
        return LEFT + (at - origin) * scale

    colours = {owner: OWNER_COLOURS[i % len(OWNER_COLOURS)] for i, owner in
               enumerate(dict.fromkeys(e.owner for e in entries if e.owner))}
    axis_y = 30
    out = [_text(12, 14, f"from {utc(origin)}, span {ago(span)}", size=10, fill=MUTED)]
    out += _axis(axis_y, span, scale)
    y = axis_y + 12
    for lane, token in enumerate(lanes):
        if lane % 2:
            out.append(f'<rect x="4" y="{y - 4}" width="{WIDTH - 8}" height="{LANE}" '
                       'fill="#f6f6f6"/>')
        mine = [e for e in entries if e.token == token]
        if token is None:
            out.append(_text(12, y + BAR - 3, "key", weight="bold"))
        else:
            current = record is not None and record.token == token
            out.append(_text(12, y + BAR - 3, f"token {token}" + (" (current)" if current
                                                                     else ""), weight="bold"))
            out += _bar(mine, token, x, y, colours, ongoing=live and current, now=now)
        out += _marks(mine, x, y)
        y += LANE
    height = y + 6
    return Safe(
        f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" width="{WIDTH}" '
        f'height="{height}" viewBox="0 0 {WIDTH} {height}" role="img" '
        f'font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="11">'
        f'<rect width="{WIDTH}" height="{height}" fill="#ffffff"/>'
        + "".join(out) + "</svg>")


def _axis(y: int, span: float, scale: float) -> list[str]:
    step = next((s for s in _STEPS if span / s <= 10), None) or _round_step(span / 10)
    out = [_line(LEFT, y, WIDTH - RIGHT, y, MUTED)]
    tick = 0.0
    while tick <= span + 1e-9:
        px = LEFT + tick * scale
        out.append(_line(px, y - 3, px, y + 3, MUTED))
        out.append(_text(px, y - 5, f"+{ago(tick)}" if tick else "0", size=9, anchor="middle",
                         fill=MUTED))
        tick += step
    return out


def _round_step(at_least: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten seconds that is ``at_least``: spans beyond
    a few weeks get about ten ticks too (a fixed largest step drew one per week, without end:
    a span of 6e10 s was 20 MB of SVG)."""
    power = 10.0 ** math.floor(math.log10(at_least))
    return next(power * m for m in (1, 2, 5, 10) if power * m >= at_least)


def _bar(mine: list[HistoryEntry], token: int, x: _X, y: int,
         colours: dict[str, str], *, ongoing: bool, now: float) -> Iterable[str]:
    """The generation's bar: from its claim (or first event) to its end (or now)."""
    start = next((e for e in mine if e.event in _STARTS), mine[0])
    finish = next((e for e in mine if e.event in _ENDS and e.at >= start.at), None)
    ongoing = ongoing and finish is None
    stop = finish.at if finish is not None else (now if ongoing else mine[-1].at)
    owner = start.owner or "?"
    how = "taken over" if start.event == "taken_over" else "claimed"
    ended = (f"until {finish.event}" if finish is not None
             else "still held" if ongoing else "end not recorded")
    tip = (f"token {token} {how} by {owner} at {utc(start.at)}; {ended} after "
           f"{ago(stop - start.at)}")
    width = max(2.0, x(stop) - x(start.at))
    yield (f'<rect x="{x(start.at):.1f}" y="{y}" width="{width:.1f}" height="{BAR}" rx="2" '
           f'fill="{colours.get(owner, MUTED)}"><title>{h(tip)}</title></rect>')
    if ongoing:
        yield _text(x(stop) + 3, y + BAR - 3, "▶ now", size=9, fill=INK)
    label = f"t{token} {_short(owner)}" + (" ⤳ takeover" if start.event == "taken_over" else "")
    if width > 60:
        yield _text(x(start.at) + 3, y + BAR - 3, label, size=9, fill="#ffffff")
    else:
        yield _text(x(start.at) + 3, y + BAR + 9, label, size=8, fill=INK)


def _marks(mine: list[HistoryEntry], x: _X, y: int) -> Iterable[str]:
    for entry in mine:
        if entry.event in _STARTS:
            continue
        if entry.event.startswith("operator:"):
            symbol, colour, label = "▲", INK, entry.event.split(":", 1)[1]
        else:
            symbol, colour, label = MARKS.get(entry.event, ("•", MUTED, entry.event))
        tip = "; ".join(part for part in (
            f"{entry.event} at {utc(entry.at)}",
            f"owner {entry.owner}" if entry.owner else "",
            f"token {entry.token}" if entry.token is not None else "",
            f"fence {entry.fence}" if entry.fence is not None else "",
            entry.detail or "") if part)
        px = x(entry.at)
        yield (f'<text x="{px:.1f}" y="{y + BAR - 2}" font-size="13" fill="{colour}" '
               f'text-anchor="middle" font-weight="bold">{h(symbol)}'
               f"<title>{h(tip)}</title></text>")
        if label:
            yield _text(px + 8, y + BAR - 3, label, size=9, fill=colour, weight="bold")


def _short(owner: str) -> str:
    """``host:pid:uuid/3`` → ``host:pid/3``: enough to tell owners apart on a bar."""
    parts = owner.split(":")
    if len(parts) >= 3:
        suffix = parts[-1].partition("/")[2]
        owner = ":".join(parts[:2]) + (f"/{suffix}" if suffix else "")
    return owner if len(owner) <= 32 else owner[:31] + "…"


def _text(x: float, y: float, text: str, *, size: int = 11, fill: str = INK,
          anchor: str = "start", weight: str = "normal") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" fill="{fill}" '
            f'text-anchor="{anchor}" font-weight="{weight}">{h(text)}</text>')


def _line(x1: float, y1: float, x2: float, y2: float, colour: str) -> str:
    return (f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
            f'stroke="{colour}" stroke-width="1"/>')
