"""The dashboard's pages: each reads the store and returns a :class:`Page` of escaped HTML.

Lists reload themselves; a page that shows an action form does not (a reload would throw away
what the operator is typing). Forms appear only when the app has an operator token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..limits import LimitGroup
from ..models import EffectState, HistoryEntry, LeaseRecord, LeaseState, Receipt
from ..ops import internal_row
from ..stores.base import Store
from .html import Safe, ago, h, join, json_block, link, table, url, when
from .timeline import timeline_svg

__all__ = ["Page", "View", "dead", "events", "key_page", "limits", "lookup", "overview",
           "receipt_page", "reconcile", "running"]

#: Events listed as "recent takeovers and stale refusals".
INCIDENTS = ("taken_over", "stale_refused")


@dataclass(frozen=True)
class Page:
    title: str
    body: Safe
    #: False on pages with a form (and on errors): they do not reload themselves.
    refresh: bool = True
    status: int = 200


@dataclass(frozen=True)
class View:
    """What a page needs: the store, the app's URL prefix and, with actions, the CSRF token."""

    store: Store
    base: str
    csrf: str | None  # None: read-only, no forms

    def key_link(self, key: str | None) -> Safe:
        """A link to the key's page; a row lease_celery keeps for itself carries a note saying
        what it is, so that it never reads as a user's key (``ops.internal_row``)."""
        if key is None:
            return Safe("&ndash;")
        note = internal_row(key)
        found = link(url(self.base, "/key", key=key), key)
        return found if note is None else Safe(f'{found} <small class="note">({h(note)})</small>')

    def receipt_link(self, key: str) -> Safe:
        return link(url(self.base, "/receipt", key=key), key)


def _section(title: str, body: Safe, more: str | None = None, view: View | None = None) -> Safe:
    tail = "" if more is None or view is None else link(url(view.base, more), "all →")
    return Safe(f'<section><h2>{h(title)} {tail}</h2>{body}</section>')


# -- rows, shared by the overview and the full lists ---------------------------------------------

def _claimed_at(record: LeaseRecord, history: Sequence[HistoryEntry]) -> float | None:
    """When the running generation was claimed (from the key's history), if recorded."""
    for entry in reversed(history):
        if entry.token == record.token and entry.event in ("claimed", "taken_over"):
            return entry.at
    return None


def _running_table(view: View, records: Sequence[LeaseRecord], now: float) -> Safe:
    rows = []
    # One read for every row's history (one per row was an N+1 at ?limit=1000).
    histories = view.store.history_many([r.key for r in records], limit=20)
    for r in records:
        started = _claimed_at(r, histories.get(r.key, []))
        expiry: object = "–"
        if r.expires_at is not None:
            left = r.expires_at - now
            expiry = (Safe(f'<span class="bad">expired {h(ago(-left))} ago</span>') if left <= 0
                      else ago(left))
        rows.append([view.key_link(r.key), r.owner, r.token,
                     "–" if started is None else ago(now - started), expiry,
                     when(r.updated_at, now), f"{r.attempts}/{r.takeovers}",
                     r.cancel or ""])
    return table(["key", "owner", "token", "age", "expires in", "last renewal",
                  "tries/takeovers", "cancel"], rows, empty="no running leases",
                 cls="running")


def _dead_table(view: View, records: Sequence[LeaseRecord], now: float) -> Safe:
    rows = [[view.key_link(r.key), Safe(f'<span class="reason">{h(r.reason)}</span>'),
             when(r.updated_at, now), r.attempts, r.token, (r.task or {}).get("task", "–")]
            for r in records]
    return table(["key", "reason", "died", "tries", "token", "task"], rows,
                 empty="no dead keys", cls="dead")


def _receipt_table(view: View, receipts: Sequence[Receipt], now: float) -> Safe:
    rows = [[view.receipt_link(r.key), view.key_link(r.lease_key),
             Safe(f'<code title="{h(r.fingerprint)}">{h(r.fingerprint[:16])}…</code>'),
             r.attempts, r.lease_token, r.lease_owner, when(r.started_at, now),
             when(r.updated_at, now)] for r in receipts]
    return table(["effect key", "lease key", "payload fingerprint", "attempt", "lease token",
                  "lease owner", "started", "marked"], rows,
                 empty="no receipt needs reconciliation", cls="receipts")


def _event_table(view: View, entries: Sequence[HistoryEntry], now: float, *,
                 with_key: bool = True) -> Safe:
    rows = []
    for e in entries:
        badge = Safe(f'<span class="ev ev-{h(e.event.split(":")[0])}">{h(e.event)}</span>')
        row: list[object] = [when(e.at, now), badge]
        if with_key:
            row.append(view.key_link(e.key))
        rows.append([*row, e.owner, e.token, e.fence, e.detail])
    headers = ["when", "event", *(["key"] if with_key else []), "owner", "token", "fence",
               "detail"]
    return table(headers, rows, empty="nothing recorded", cls="events")


def _limits_table(groups: Sequence[LimitGroup], now: float) -> Safe:
    rows = [[g.group, "–" if g.limit is None else g.limit, g.rate or "–", g.running,
             Safe(f'<span class="bad">{g.waiting}</span>') if g.waiting else 0,
             ", ".join(g.overridden) or "–",
             when(g.updated_at, now)] for g in groups]
    return table(["group", "limit", "rate", "running", "waiting", "set by an operator",
                  "changed"], rows, empty="no limit groups", cls="limits")


def _counts(view: View) -> Safe:
    stats = view.store.stats()
    rows = [[Safe(f'<span class="st st-{state.value}">{h(state.value)}</span>'),
             stats.counts.get(state.value, 0)] for state in LeaseState]
    rows.append([Safe('<span class="bad">expired</span>'), stats.expired])
    rows.append(["total", stats.total])
    return table(["state", "leases"], rows, cls="counts")


# -- pages ---------------------------------------------------------------------------------------

def overview(view: View, *, limit: int = 10) -> Page:
    store, now = view.store, view.store.now()
    queue = store.effects.find(state=EffectState.NEEDS_RECONCILIATION, limit=limit)
    body = join([
        _section("Counts by state", _counts(view)),
        _section("Reconciliation queue", _receipt_table(view, queue, now), "/reconcile", view),
        _section("Dead keys", _dead_table(view, store.find(state=LeaseState.DEAD, limit=limit),
                                          now), "/dead", view),
        _section("Running leases", _running_table(
            view, store.find(state=LeaseState.RUNNING, limit=limit), now), "/running", view),
        _section("Recent takeovers and stale refusals", _event_table(
            view, store.recent_history(events=INCIDENTS, limit=limit), now), "/events", view),
        _section("Limit groups", _limits_table(store.limits(limit=limit), now), "/limits",
                 view),
    ])
    return Page("Overview", body)


def limits(view: View, *, limit: int = 100) -> Page:
    now = view.store.now()
    intro = Safe('<p class="help">Key-group limits: at most <i>limit</i> of a group run at '
                 "once, at most <i>rate</i> start; deliveries over the limit wait on the "
                 "store in arrival order, holding no worker. <code>celery leases limit GROUP "
                 "--limit N</code> changes a limit without a deploy.</p>")
    return Page("Limit groups", join([intro, _limits_table(view.store.limits(limit=limit),
                                                             now)]))


def running(view: View, *, limit: int = 100) -> Page:
    now = view.store.now()
    records = view.store.find(state=LeaseState.RUNNING, limit=limit)
    return Page("Running leases", _running_table(view, records, now))


def events(view: View, *, limit: int = 100) -> Page:
    now = view.store.now()
    entries = view.store.recent_history(events=INCIDENTS, limit=limit)
    return Page("Recent takeovers and stale refusals", _event_table(view, entries, now))


def dead(view: View, *, limit: int = 100) -> Page:
    now = view.store.now()
    return Page("Dead keys", _dead_table(view, view.store.find(state=LeaseState.DEAD,
                                                               limit=limit), now))


def reconcile(view: View, *, limit: int = 100) -> Page:
    now = view.store.now()
    queue = view.store.effects.find(state=EffectState.NEEDS_RECONCILIATION, limit=limit)
    intro = Safe('<p class="help">An attempt started each of these outside actions and never '
                 "recorded its outcome. Check the target, then open the receipt: "
                 "<b>resolve</b> it if the action happened (with its result), <b>discard</b> "
                 "it if it did not, and <b>requeue</b> its lease so the task runs again and "
                 "replays the receipt.</p>")
    return Page("Reconciliation queue", join([intro, _receipt_table(view, queue, now)]))


def lookup(view: View) -> Page:
    body = Safe(f'<form method="get" action="{h(url(view.base, "/key"))}" class="lookup">'
                '<label>lease key <input type="text" name="key" size="60"></label> '
                '<button type="submit">show</button></form>')
    return Page("Find a key", body, refresh=False)


def _fields(items: Sequence[tuple[str, object]]) -> Safe:
    rows = "".join(f"<tr><th>{h(name)}</th><td>{h(value)}</td></tr>" for name, value in items)
    return Safe(f'<table class="fields">{rows}</table>')


def _form(view: View, action: str, key: str, submit: str, fields: str = "") -> Safe:
    """A POST form for ``action`` on ``key``: the key travels in the URL (percent-encoded, so
    a browser cannot rewrite its line breaks), the CSRF token and the operator token in the
    body."""
    assert view.csrf is not None
    return Safe(
        f'<form method="post" action="{h(url(view.base, "/" + action, key=key))}" '
        f'id="{h(action)}" class="action">'
        f'<input type="hidden" name="csrf" value="{h(view.csrf)}">{fields}'
        '<label>operator token <input type="password" name="token" autocomplete="off">'
        f'</label> <button type="submit">{h(submit)}</button></form>')


def receipt_page(view: View, key: str) -> Page:
    store, now = view.store, view.store.now()
    receipt = store.effects.get(key)
    if receipt is None:
        return Page("No such receipt", Safe(f"<p>No effect receipt for {h(repr(key))}.</p>"),
                    refresh=False, status=404)
    info = _fields([
        ("effect key", receipt.key), ("state", receipt.state.value),
        ("payload fingerprint", Safe(f"<code>{h(receipt.fingerprint)}</code>")),
        ("attempt", receipt.attempts), ("lease key", view.key_link(receipt.lease_key)),
        ("lease token", receipt.lease_token), ("lease owner", receipt.lease_owner),
        ("started", when(receipt.started_at, now)), ("updated", when(receipt.updated_at, now)),
        ("result", json_block(receipt.result) if receipt.state is EffectState.DONE else "–")])
    parts = [info]
    actionable = receipt.state is EffectState.NEEDS_RECONCILIATION
    forms = view.csrf is not None and actionable
    if forms:
        parts.append(Safe("<h2>Reconcile</h2>"))
        parts.append(_form(
            view, "resolve", key, "resolve: it happened",
            '<label>result (JSON; other text is stored as a string) '
            '<input type="text" name="result" size="40"></label> '))
        parts.append(_form(view, "discard", key, "discard: it did not happen"))
    if not actionable:
        parts.append(Safe(f"<p>This receipt is {h(receipt.state.value)}: nothing to "
                          "reconcile.</p>"))
    lease = None if receipt.lease_key is None else store.get(receipt.lease_key)
    if view.csrf is not None and lease is not None and lease.state is LeaseState.DEAD:
        forms = True
        parts.append(Safe(f"<h2>Lease {h(lease.key)} is dead</h2>"
                          f'<p class="reason">{h(lease.reason)}</p>'))
        parts.append(_form(view, "requeue", lease.key, "requeue the lease"))
    return Page(f"Receipt {key}", join(parts), refresh=not forms)


def key_page(view: View, key: str) -> Page:
    store, now = view.store, view.store.now()
    record = store.get(key)
    history = store.history(key, limit=200)
    if record is None and not history:
        return Page("No such key", Safe(f"<p>No lease and no history for {h(repr(key))}.</p>"),
                    refresh=False, status=404)
    parts: list[object] = []
    if record is None:
        parts.append(Safe("<p>No row (purged, or never claimed); its history:</p>"))
    else:
        task = record.task or {}
        parts.append(_fields([
            ("key", record.key),
            *([("what", internal_row(record.key))] if internal_row(record.key) else []),
            ("state", Safe(f'<span class="st st-{h(record.state.value)}">'
                           f"{h(record.state.value)}</span>"
                           + (" (settling)" if record.settling else ""))),
            ("owner", record.owner), ("token", record.token), ("fence", record.fence),
            ("expires", when(record.expires_at, now)), ("updated", when(record.updated_at, now)),
            ("not before", when(record.not_before, now)),
            ("tries / takeovers", f"{record.attempts} / {record.takeovers}"),
            ("reason", record.reason), ("cancel", record.cancel),
            ("task", f"{task.get('task', '–')} (id {record.task_id or '–'})")]))
        parts.append(_section("Checkpoint", json_block(record.checkpoint)
                              if record.checkpoint is not None else Safe("<p>none</p>")))
        if record.state is LeaseState.DONE:
            parts.append(_section("Result", json_block(record.result)))
        if record.task and record.task.get("args") is not None:
            parts.append(_section("Task arguments", json_block(
                {"args": record.task.get("args"), "kwargs": record.task.get("kwargs")})))
    waiting = [r for r in store.effects.find(state=EffectState.NEEDS_RECONCILIATION, limit=500)
               if r.lease_key == key]
    if waiting:
        parts.append(_section("Receipts of this lease awaiting reconciliation",
                              _receipt_table(view, waiting, now)))
    forms = view.csrf is not None and record is not None and record.state is LeaseState.DEAD
    if forms:
        parts.append(_section("Requeue", _form(
            view, "requeue", key, "requeue",
            '<label>reason <input type="text" name="reason" size="30" '
            'value="requeued from the web dashboard"></label> ')))
    parts.append(_section("History", join([
        timeline_svg(history, record=record, now=now),
        _event_table(view, history, now, with_key=False)])))
    return Page(f"Key {key}", join(parts), refresh=not forms)


def sign_in(view: View, *, next_path: str) -> Page:
    """The page every other page is with ``protect_reads`` until this browser signed in: a
    form for the operator token, and nothing of the store."""
    assert view.csrf is not None
    return Page("Sign in", Safe(
        "<p>This dashboard shows its pages only to whoever has the operator token.</p>"
        f'<form method="post" action="{h(url(view.base, "/sign-in", next=next_path))}" '
        'id="sign-in" class="action">'
        f'<input type="hidden" name="csrf" value="{h(view.csrf)}">'
        '<label>operator token <input type="password" name="token" autocomplete="off">'
        '</label> <button type="submit">Sign in</button></form>'), refresh=False, status=401)
