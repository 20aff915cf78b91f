"""The lease timeline as one self-contained SVG file (no scripts, fonts or links).

One panel per mode, on one time scale. Each report is a row: a thin lane of deliveries on top
(published by the demo, deferred by a live lease, dropped as done, re-published by a sweeper),
then one bar per body
execution, coloured by worker process. Under a leased bar, a line shows how long the store
granted the lease; a takeover shows as the next token's bar starting after that line ends.
Hovering any mark shows its details (SVG <title>).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from xml.sax.saxutils import escape, quoteattr

from ..receiver import Received
from .history import Execution, History, LeaseSpan

__all__ = ["svg"]

WIDTH = 1180
LEFT = 150          # row labels
RIGHT = 24
DELIVERY_LANE = 14
LANE = 22
BAR = 13
ROW_GAP = 10
WORKER_COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948"]
GOOD, BAD, MUTED, INK = "#2e7d32", "#c62828", "#8a8a8a", "#222222"

#: (title, one-line summary, history, what the outside service received)
Run = tuple[str, str, History, list[Received]]
#: Time (epoch seconds) -> x (pixels).
_X = Callable[[float], float]


def svg(runs: list[Run], *, ttl: float) -> str:
    """Draw every run (title, history, what the outside service received) on one time scale."""
    origins = [_origin(h) for _, _, h, _ in runs]
    span = max([_last(h) - o for (_, _, h, _), o in zip(runs, origins, strict=True)] + [1.0])
    span += 1.5  # room for the labels right of the last marks
    scale = (WIDTH - LEFT - RIGHT) / span
    body: list[str] = []
    y = 46
    for (title, summary, history, received), origin in zip(runs, origins, strict=True):
        panel, y = _panel(title, summary, history, received, origin=origin, scale=scale,
                          top=y, span=span)
        body.extend(panel)
        y += 26
    legend, y = _legend(y, ttl)
    body.extend(legend)
    head = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{y + 10}" '
        f'viewBox="0 0 {WIDTH} {y + 10}" font-family="DejaVu Sans, Helvetica, Arial, '
        f'sans-serif" font-size="11">',
        "<defs><pattern id=\"stalled\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\""
        " patternTransform=\"rotate(45)\"><rect width=\"6\" height=\"6\" fill=\"#ffffff\"/>"
        "<line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#555555\" stroke-width=\"3\"/>"
        "</pattern></defs>",
        f'<rect width="{WIDTH}" height="{y + 10}" fill="#ffffff"/>',
        _text(12, 24, "lease_celery demo: who held which report, under which token, and what "
              "happened to every delivery", size=15, weight="bold"),
    ]
    return "\n".join([*head, *body, "</svg>"]) + "\n"


def _panel(title: str, summary: str, history: History, received: list[Received], *,
           origin: float, scale: float, top: int, span: float) -> tuple[list[str], int]:
    def x(t: float) -> float:
        return LEFT + (t - origin) * scale

    out = [_text(12, top + 4, title, size=13, weight="bold"),
           _text(12, top + 18, summary, size=10, fill=MUTED)]
    axis_y = top + 40
    out.append(_line(LEFT, axis_y, WIDTH - RIGHT, axis_y, MUTED))
    for second in range(int(span) + 1):
        px = LEFT + second * scale
        out.append(_line(px, axis_y - 3, px, axis_y + 3, MUTED))
        out.append(_text(px, axis_y - 5, f"{second}s", size=9, anchor="middle", fill=MUTED))
    colours = _worker_colours(history)
    y = axis_y + 10
    for report_id in _report_ids(history):
        executions = history.executions_of(report_id)
        lanes = _lanes(executions)
        height = DELIVERY_LANE + max(1, len(set(lanes.values()))) * LANE
        out.append(f'<rect x="4" y="{y - 2}" width="{WIDTH - 8}" height="{height + 4}" '
                   f'fill="{"#f6f6f6" if report_id % 2 else "#ffffff"}"/>')
        out.append(_text(12, y + 16, f"report {report_id}", weight="bold"))
        out.append(_text(12, y + 29, _scene_of(history, report_id), size=9, fill=MUTED))
        out.extend(_deliveries(history, report_id, x, y + 8))
        spans = [s for s in history.leases if s.report_id == report_id]
        for execution in executions:
            lane_y = y + DELIVERY_LANE + lanes[id(execution)] * LANE
            out.extend(_execution(execution, spans, x, lane_y, colours, history))
        out.extend(_effects(received, executions, report_id, x, y, lanes))
        y += height + ROW_GAP
    return out, y


def _execution(ex: Execution, spans: list[LeaseSpan], x: _X, y: float,
               colours: dict[str, str], history: History) -> Iterable[str]:
    end = ex.end if ex.end is not None else _last(history)
    worker = ex.worker.split("@", 1)[0]
    token = f" · token {ex.token}" if ex.token is not None else ""
    tip = (f"{ex.worker} pool pid {ex.pid}{token}; delivery copy {ex.copy or '?'} "
           f"(message published by: {ex.origin}); "
           f"body {ex.started - _origin(history):.2f}s → {end - _origin(history):.2f}s")
    width = max(2.0, x(end) - x(ex.started))
    yield (f'<rect x="{x(ex.started):.1f}" y="{y:.1f}" width="{width:.1f}" height="{BAR}" '
           f'rx="2" fill="{colours.get(ex.worker, MUTED)}">'
           f"<title>{escape(tip)}</title></rect>")
    if ex.stalled is not None:
        resumed = ex.resumed if ex.resumed is not None else end
        yield (f'<rect x="{x(ex.stalled):.1f}" y="{y:.1f}" '
               f'width="{max(2.0, x(resumed) - x(ex.stalled)):.1f}" height="{BAR}" '
               f'fill="url(#stalled)" stroke="#555555"><title>SIGSTOP → SIGCONT: stalled '
               f"{resumed - ex.stalled:.1f}s</title></rect>")
        middle = (x(ex.stalled) + x(resumed)) / 2
        yield (f'<rect x="{middle - 52:.1f}" y="{y + 1:.1f}" width="104" height="{BAR - 2}" '
               'fill="#ffffff" opacity="0.9"/>')
        yield _text(middle, y + BAR - 3, "SIGSTOP … SIGCONT", size=9, anchor="middle",
                    weight="bold")
    again = " ↻" if ex.redelivered else " ⟳" if ex.origin == "sweeper" else ""
    label = f"{worker} pid {ex.pid}{token.replace(' · token ', ' t')}{again}"
    yield _text(x(ex.started) + 3, y + BAR - 3, label, size=9, fill="#ffffff")
    for lease in spans:
        if lease.pid == ex.pid and lease.token == ex.token:
            ly = y + BAR + 3
            yield (f'<line x1="{x(lease.acquired):.1f}" y1="{ly}" x2="{x(lease.expires_at):.1f}"'
                   f' y2="{ly}" stroke="{INK}" stroke-width="2"><title>lease token '
                   f"{lease.token}: held until {lease.expires_at - _origin(history):.2f}s"
                   f"{' (finished)' if lease.finished else ' (expired)'}</title></line>")
            if lease.finished is None:
                yield _line(x(lease.expires_at), ly - 3, x(lease.expires_at), ly + 3, INK)
                yield _text(x(lease.expires_at) + 3, ly + 4, f"lease t{lease.token} expires",
                            size=8, fill=INK)
    if ex.killed is not None:
        yield _cross(x(ex.killed), y + BAR / 2, BAD, "SIGKILL: worker and pool process killed")
        yield _text(x(ex.killed) + 7, y + BAR - 2, "SIGKILL", size=9, fill=BAD, weight="bold")
    if ex.refused is not None:
        yield _mark(x(ex.refused), y + BAR / 2, BAD, "⊘",
                    f"stale outcome refused by the lease store: {ex.refused_reason}")
        yield _text(x(ex.refused) + 8, y + BAR - 2, "stale: refused", size=9, fill=BAD,
                    weight="bold")
    if ex.state == "SUCCESS" and ex.token is not None and ex.ended is not None:
        yield _mark(x(ex.ended), y + BAR / 2, GOOD, "✓", "result accepted by the lease store")
    if ex.written is not None:
        colour, text = ((BAD, "stale write accepted: overwrote a newer build")
                        if ex.overwrote_newer else (GOOD, "result written (blind overwrite)"))
        yield _mark(x(ex.written), y + BAR / 2, colour, "✓", text)
        if ex.overwrote_newer:
            yield _text(x(ex.written) + 8, y + BAR - 2, "stale write accepted", size=9,
                        fill=BAD, weight="bold")


def _deliveries(history: History, report_id: int, x: _X, y: float) -> Iterable[str]:
    for event in history.for_report("published", report_id):
        copy = event.get("copy")
        yield _mark(x(event["t"]), y, INK, "▼",
                    f"the demo published delivery copy {copy} (task id {event['task_id']})",
                    size=9)
        yield _text(x(event["t"]) + 6, y + 3, f"#{copy}", size=8, fill=INK)
    for event in history.for_report("duplicate_deferred", report_id):
        yield _mark(x(event["t"]), y, MUTED, "◆",
                    f"pid {event['pid']}: lease held by {event.get('holder')}: deferred "
                    f"{event.get('countdown', 0):.2f}s", size=10)
    for event in history.for_report("duplicate_ignored", report_id):
        yield _mark(x(event["t"]), y, MUTED, "●",
                    f"pid {event['pid']}: report already {event.get('state')}: dropped", size=9)
    for event in history.for_report("lease_swept", report_id):
        yield _mark(x(event["t"]), y, GOOD, "⟳",
                    f"worker main process pid {event['pid']}: lease token "
                    f"{event.get('record_token')} of {event.get('record_owner')} expired without "
                    "renewal: the sweeper re-published the task recorded on the lease row",
                    size=11)
        yield _text(x(event["t"]) + 7, y + 3, "swept", size=8, fill=GOOD)


def _effects(received: list[Received], executions: list[Execution], report_id: int, x: _X,
             y: float, lanes: dict[int, int]) -> Iterable[str]:
    mine = [r for r in received if r["report_id"] == report_id]
    for n, request in enumerate(mine, start=1):
        pid = _sender_pid(request["sender"])
        lane = next((lanes[id(e)] for e in executions if e.pid == pid
                     and e.started <= request["received_at"]), 0)
        ly = y + DELIVERY_LANE + lane * LANE - 1
        colour = GOOD if n == 1 else BAD
        tip = (f"the outside service received report {report_id} "
               f"({'first time' if n == 1 else f'{n}th time: duplicate effect'}) from "
               f"{request['sender']}")
        yield _mark(x(request["received_at"]), ly, colour, "▲", tip, size=10)
        if n > 1:
            yield _text(x(request["received_at"]) + 6, ly + 1, "duplicate effect", size=8,
                        fill=BAD, weight="bold")


def _legend(y: int, ttl: float) -> tuple[list[str], int]:
    items = [
        ("▼", INK, "#n: a delivery the demo published (#2 carries the same task id)"),
        ("◆", MUTED, "delivery deferred: the lease was held by a live owner"),
        ("●", MUTED, "delivery dropped: the report was already done"),
        ("▲", GOOD, "request received by the outside service (red: a duplicate effect)"),
        ("✓", GOOD, "result accepted (red: a stale write accepted)"),
        ("⊘", BAD, "stale outcome refused by the lease store"),
        ("✕", BAD, "SIGKILL of the whole worker"),
        ("⟳", GOOD, "the sweeper re-published an expired lease's task (bar label ⟳: that run)"),
        ("━", INK, f"lease granted by the store (ttl {ttl:g}s, renewed by the heartbeat)"),
    ]
    out = [_text(12, y + 4, "legend", weight="bold")]
    for i, (symbol, colour, text) in enumerate(items):
        column, row = divmod(i, 5)
        lx, ly = 20 + column * 560, y + 22 + row * 16
        out.append(_text(lx, ly, symbol, fill=colour, size=12, weight="bold"))
        out.append(_text(lx + 18, ly, text, size=10))
    out.append(_text(20, y + 22 + 5 * 16, "bars: one body execution each, coloured by worker, "
                     "labelled worker, pool pid, token (↻: redelivered by the broker, ⟳: run of a "
                     "sweeper's re-publish); hatched: "
                     "the pool process was stopped (SIGSTOP). Hover for details.",
                     size=10, fill=MUTED))
    return out, y + 22 + 5 * 16 + 8


# -- helpers -------------------------------------------------------------------------------------

def _lanes(executions: list[Execution]) -> dict[int, int]:
    """Put overlapping executions of one report on separate lanes (greedy interval colouring)."""
    ends: list[float] = []
    lanes: dict[int, int] = {}
    for execution in sorted(executions, key=lambda e: e.started):
        end = execution.end if execution.end is not None else float("inf")
        for lane, lane_end in enumerate(ends):
            if lane_end <= execution.started:
                ends[lane] = end
                lanes[id(execution)] = lane
                break
        else:
            ends.append(end)
            lanes[id(execution)] = len(ends) - 1
    return lanes


def _worker_colours(history: History) -> dict[str, str]:
    names = sorted({e.worker for e in history.executions})
    return {name: WORKER_COLOURS[i % len(WORKER_COLOURS)] for i, name in enumerate(names)}


def _report_ids(history: History) -> list[int]:
    ids = {e.get("report_id") for e in history.of("published")}
    return sorted(i for i in ids if isinstance(i, int))


def _scene_of(history: History, report_id: int) -> str:
    executions = history.executions_of(report_id)
    if any(x.killed is not None for x in executions):
        lost = not any(x.state == "SUCCESS" or x.written is not None for x in executions)
        return "scene 2: SIGKILL" + (" · LOST" if lost else "")
    if any(x.stalled is not None for x in executions):
        return "scene 3: stall"
    return "scene 1: duplicate"


def _sender_pid(sender: str) -> int | None:
    try:
        return int(sender.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


def _origin(history: History) -> float:
    return min((e["t"] for e in history.events), default=0.0)


def _last(history: History) -> float:
    relevant = [e["t"] for e in history.events
                if e["event"] not in ("worker_ready", "lease_renewed")]
    return max(relevant, default=_origin(history))


def _text(x: float, y: float, text: str, *, size: int = 11, fill: str = INK,
          anchor: str = "start", weight: str = "normal") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" fill="{fill}" '
            f'text-anchor="{anchor}" font-weight="{weight}">{escape(text)}</text>')


def _line(x1: float, y1: float, x2: float, y2: float, colour: str) -> str:
    return (f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
            f'stroke="{colour}" stroke-width="1"/>')


def _mark(x: float, y: float, colour: str, symbol: str, tip: str, *, size: int = 12) -> str:
    return (f'<text x="{x:.1f}" y="{y + size / 3:.1f}" font-size="{size}" fill="{colour}" '
            f'text-anchor="middle" font-weight="bold">{escape(symbol)}'
            f"<title>{escape(tip)}</title></text>")


def _cross(x: float, y: float, colour: str, tip: str) -> str:
    return (f'<g stroke={quoteattr(colour)} stroke-width="2.5"><title>{escape(tip)}</title>'
            f'<line x1="{x - 5:.1f}" y1="{y - 5:.1f}" x2="{x + 5:.1f}" y2="{y + 5:.1f}"/>'
            f'<line x1="{x - 5:.1f}" y1="{y + 5:.1f}" x2="{x + 5:.1f}" y2="{y - 5:.1f}"/></g>')
