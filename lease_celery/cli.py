"""``celery -A proj leases …`` and ``python -m lease_celery -A proj …``: see and act on leases.

Exit codes: 0 done; 1 the key is missing or not in a state that allows the action, or
``doctor`` found an error; 2 bad usage. ``--json`` prints machine-readable output.
"""

from __future__ import annotations

import functools
import getpass
import json
import re
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any, NoReturn

import click

from .doctor import diagnose
from .errors import ConfigError, InvalidKey, LeaseError
from .limits import LimitGroup, check_concurrency, parse_rate
from .models import EffectState, HistoryEntry, LeaseRecord, LeaseState, Receipt
from .ops import Done, Operations, Refusal, internal_row
from .settings import store_url_of
from .stores.base import Store
from .stores.registry import open_store
from .stores.urls import redact
from .worker.sweeper import sweep_report

__all__ = ["leases", "main"]

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw]?)$")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``12h``, ``7d``, ``2w`` → seconds."""
    match = _DURATION.match(text.strip())
    if match is None:
        raise click.BadParameter(f"{text!r} is not a duration such as 30s, 15m, 12h or 7d")
    return float(match.group(1)) * _UNIT[match.group(2)]


#: The refusal when no app is named (Celery's program then hands over its default app).
NO_APP = ("name the app: celery -A APP leases … (or python -m lease_celery -A APP …); "
          "without it nothing is read, written or published")


class Context:
    """What every sub-command needs: the app, the store URL and the output format.

    ``--store`` and ``--json`` may be given before or after the sub-command (the one after
    wins); ``load_error`` is why the app module did not import (``doctor`` reports it)."""

    def __init__(self, app: Any, store_url: str | None, as_json: bool,
                 load_error: BaseException | None = None, refusal: str | None = None) -> None:
        self.app, self.as_json, self.load_error = app, as_json, load_error
        self.store_override = store_url
        #: Why no command may run (no app named, or it did not import); said as the command
        #: starts, after its options are parsed, so ``COMMAND --help`` still helps.
        self.refusal = refusal

    @property
    def store_url(self) -> str:
        if self.store_override is not None:  # "" too: open_store names what is wrong
            return self.store_override
        try:
            return store_url_of(self.app)
        except ConfigError as exc:
            _refuse(f"{exc} (celery leases doctor explains the app's settings)")
        except Exception as exc:  # the app's configuration itself did not load
            _refuse(f"the app's configuration does not load: {type(exc).__name__}: {exc}")

    @contextmanager
    def store(self) -> Iterator[Store]:
        url = self.store_url
        try:
            with open_store(url) as store:
                yield store
        except (ConfigError, InvalidKey) as exc:  # a bad setting, or the command's bad key
            _refuse(str(exc))
        except ValueError as exc:  # a URL no store could even read (stores connect lazily)
            _refuse(f"lease store URL {redact(url)!r} is not usable: {exc}")
        except (LeaseError, ImportError) as exc:  # ImportError: the store's extra is missing
            raise click.ClickException(_one_line(str(exc))) from exc


def _refuse(message: str) -> NoReturn:
    """Bad usage: one line on stderr, exit 2, nothing done."""
    click.echo(f"Error: {_one_line(message)}", err=True)
    sys.exit(2)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _printable(value: object) -> str:
    """``value`` as text a terminal shows as it is: control and format characters (newline,
    tab, escape, bidi overrides) escaped, so a key cannot break a table or restyle the
    terminal."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


def _set_store(click_ctx: click.Context, _: click.Parameter, value: str | None) -> None:
    if value is not None and isinstance(click_ctx.obj, Context):
        click_ctx.obj.store_override = value


def _set_json(click_ctx: click.Context, _: click.Parameter, value: bool) -> None:
    if value and isinstance(click_ctx.obj, Context):
        click_ctx.obj.as_json = True


def _common(command: Callable[..., Any]) -> Callable[..., Any]:
    """Every command: refused (one line, exit 2) when no app was named, before its body reads,
    writes or publishes anything; ``--store`` and ``--json`` after the sub-command too
    (``show KEY --json``)."""
    @functools.wraps(command)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        context = click.get_current_context().find_object(Context)
        if context is not None and context.refusal:
            _refuse(context.refusal)
        return command(*args, **kwargs)

    with_json = click.option("--json", "as_json", is_flag=True, expose_value=False,
                             callback=_set_json, help="Print JSON for scripts.")(guarded)
    return click.option("--store", metavar="URL", expose_value=False, callback=_set_store,
                        help="Lease store URL (default: the app's lease_store_url).")(with_json)


#: History entries ``show`` prints.
SHOW_HISTORY = 5


def _record_dict(record: LeaseRecord) -> dict[str, Any]:
    data = asdict(record)
    data["state"] = record.state.value
    return data


def _age(seconds: float | None, now: float) -> str:
    if seconds is None:
        return "-"
    delta = seconds - now
    return f"in {delta:.0f}s" if delta >= 0 else f"{-delta:.0f}s ago"


def _emit(ctx: Context, data: Any, text: str) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str) if ctx.as_json else text)


@click.group(name="leases")
@click.option("--store", "store_url", metavar="URL",
              help="Lease store URL (default: the app's lease_store_url).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def leases(click_ctx: click.Context, store_url: str | None, as_json: bool) -> None:
    """See and act on lease_celery leases (name the app: celery -A APP leases …)."""
    _start(click_ctx, store_url, as_json)


def _start(click_ctx: click.Context, store_url: str | None, as_json: bool) -> None:
    """The Context of the command: refused without an app, or with one that did not import
    (but for doctor, which reports that)."""
    app, load_error = _named_app(click_ctx)
    refusal = None
    if load_error is not None and click_ctx.invoked_subcommand != "doctor":
        refusal = str(load_error)
    elif app is None and load_error is None:
        refusal = NO_APP
    click_ctx.obj = Context(app, store_url, as_json, load_error, refusal)


def _named_app(click_ctx: click.Context) -> tuple[Any, BaseException | None]:
    """The app the user named, or None; and why it did not import (``python -m``).

    Celery's program hands every command its default app when no ``-A`` (nor ``$APP``) was
    given: that app is never the user's, so it counts as none. An app that made itself the
    default (``set_default()``) and was named is the user's."""
    from celery import _state

    obj = click_ctx.obj
    load_error = getattr(obj, "load_error", None)
    app = getattr(obj, "app", None) if obj is not None else None
    parent = click_ctx.parent
    if parent is not None and "app" in parent.params:  # celery's program: did -A name one?
        named = parent.params["app"] is not None
    elif isinstance(obj, _Loaded):  # python -m lease_celery: the app -A imported, if any
        named = app is not None
    else:  # a caller's own obj (Celery's CLIContext fills in the default app for none)
        named = app is not None and app is not _state.default_app
    return (app if named else None), load_error


#: How many rows ``list`` reads per row it shows, so that hidden internal rows do not
#: shorten the page (a page of them beyond that is counted in the footer instead).
_LIST_READ_AHEAD = 4


@leases.command(name="list")
@click.option("--state", type=click.Choice([s.value for s in LeaseState]))
@click.option("--prefix", help="Only keys starting with this.")
@click.option("--owner", help="Only leases of this owner: an execution (hostname:pid:uuid/n) "
              "or every execution of a process (hostname:pid:uuid).")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--all", "show_all", is_flag=True,
              help="Also the rows lease_celery keeps for itself (answers to duplicates, "
                   "direct calls), each named for what it is.")
@_common
@click.pass_obj
def list_(ctx: Context, state: str | None, prefix: str | None, owner: str | None,
          limit: int, show_all: bool) -> None:
    """List leases, most recently changed first."""
    with ctx.store() as store:
        found = store.find(state=None if state is None else LeaseState(state), prefix=prefix,
                           owner=owner, limit=limit if show_all else limit * _LIST_READ_AHEAD)
        now = store.now()
    records = [r for r in found if show_all or internal_row(r.key) is None][:limit]
    hidden = 0 if show_all else sum(1 for r in found if internal_row(r.key) is not None)
    rows = [(_printable(r.key), r.state.value, str(r.token), f"{r.attempts}/{r.takeovers}",
             _age(r.expires_at, now) if r.state is LeaseState.RUNNING else "-",
             _printable(r.owner or "-"), internal_row(r.key) or "") for r in records]
    header = ("KEY", "STATE", "TOKEN", "TRIES/TAKEOVERS", "EXPIRES", "OWNER",
              "NOTE" if show_all else "")
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in (header, *rows)]
    if hidden:
        lines.append(f"({hidden} internal rows hidden: answers to duplicates, direct calls; "
                     "--all lists them)")
    _emit(ctx, [_record_dict(r) for r in records], "\n".join(lines))


@leases.command()
@click.argument("key")
@_common
@click.pass_obj
def show(ctx: Context, key: str) -> None:
    """Show one lease's full record."""
    with ctx.store() as store:  # one connection for the record and its history
        record = store.get(key)
        now = store.now()
        recent = [] if record is None else store.history(key, limit=SHOW_HISTORY)
    if record is None:
        _fail(ctx, f"no lease for key {key!r}")
    assert record is not None
    data = _record_dict(record)
    note = internal_row(key)
    if note is not None:  # lease_celery's own row: say what it is, right under its key
        data = {"key": data.pop("key"), "what": note, **data}
    data["history"] = [asdict(entry) for entry in recent]
    text = "\n".join(f"{name:>11}: {_show_value(name, value, now)}"
                     if name != "expires_at" else f"{name:>11}: {_deadline(record, now)}"
                     for name, value in data.items() if name != "history")
    lines = [_history_line(entry, now) for entry in recent] or ["(none yet)"]
    _emit(ctx, data, text + f"\n    history (last {SHOW_HISTORY}; `history KEY` for all):\n"
          + "\n".join(f"      {line}" for line in lines))


@leases.command()
@click.argument("key")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@_common
@click.pass_obj
def history(ctx: Context, key: str, limit: int) -> None:
    """Everything that happened to one key, oldest first: claims, takeovers, lapses,
    outcomes, sweeps and operators' actions."""
    with ctx.store() as store:
        entries = store.history(key, limit=limit)
        now = store.now()
    if not entries:
        _fail(ctx, f"no history for key {key!r}")
    _emit(ctx, [asdict(entry) for entry in entries],
          "\n".join(_history_line(entry, now) for entry in entries))


def _history_line(entry: HistoryEntry, now: float) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(entry.at))
    who = "" if entry.owner is None else f" by {entry.owner}"
    token = "" if entry.token is None else f" token {entry.token}"
    detail = "" if entry.detail is None else f": {entry.detail}"
    return _printable(f"{when} UTC ({_age(entry.at, now)}) {entry.event}{token}{who}{detail}")


def _operations(ctx: Context, store: Store) -> Operations:
    """The operator actions on ``store``, recorded as done by this user on this host."""
    actor = f"{getpass.getuser()}@{socket.gethostname()} via the CLI"
    return Operations(store, actor=actor, app=ctx.app)


def _unrecorded(done: Done) -> None:
    if done.unrecorded is not None:
        click.echo(f"warning: {done.event} on {_printable(done.key)} was done but not recorded "
                   f"in its history: {_one_line(done.unrecorded)}", err=True)


def _deadline(record: LeaseRecord, now: float) -> str:
    """The lease's deadline as ``show`` prints it: a countdown only while someone holds the
    key. A row that is not running keeps the deadline of its last lease, which no longer
    means anything (the lease ended when the key became done, dead or ready); a running row
    past its deadline is held by no one until it is taken over."""
    if record.expires_at is None:
        return "-"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(record.expires_at))
    if record.state is not LeaseState.RUNNING:
        return f"{when} UTC (released: the key is {record.state.value}, no one holds it)"
    if record.expires_at <= now:  # the boundary instant counts as expired (the store's rule)
        return f"{when} UTC (expired {now - record.expires_at:.0f}s ago: no one holds it)"
    return f"{when} UTC ({_age(record.expires_at, now)})"


def _show_value(name: str, value: Any, now: float) -> str:
    if name in ("expires_at", "updated_at", "not_before") and isinstance(value, float):
        return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(value))} UTC " \
               f"({_age(value, now)})"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)  # JSON escapes control characters itself
    return "-" if value is None else _printable(value)


@leases.command()
@click.argument("key")
@click.option("--reason", default="released by an operator", show_default=True)
@_common
@click.pass_obj
def release(ctx: Context, key: str, reason: str) -> None:
    """Make a running lease ready, whoever holds it (its holder's result is then refused)."""
    with ctx.store() as store:
        try:
            done = _operations(ctx, store).release(key, reason=reason)
        except Refusal as exc:
            _fail(ctx, str(exc))
    _unrecorded(done)
    _emit(ctx, {"released": key}, f"released {_printable(key)}")


@leases.command()
@click.argument("key")
@click.option("--reason", default="by an operator", show_default=True)
@_common
@click.pass_obj
def cancel(ctx: Context, key: str, reason: str) -> None:
    """Cancel a key: a running holder stops at its next heartbeat, a key not yet started never
    runs; it ends dead ("cancelled: REASON") until requeued."""
    with ctx.store() as store:
        try:
            done = _operations(ctx, store).cancel(key, reason=reason)
        except Refusal as exc:
            _fail(ctx, str(exc))
    _unrecorded(done)
    record = done.record
    assert record is not None
    how = ("its holder stops at its next heartbeat" if record.state is LeaseState.RUNNING
           else "it will not run")
    _emit(ctx, {"cancelled": key, "state": record.state.value, "reason": record.cancel},
          f"cancelled {_printable(key)}: {how} ({_printable(record.cancel)})")


@leases.command()
@click.argument("key")
@click.option("--publish/--no-publish", default=True, show_default=True,
              help="Re-publish the task recorded on the lease.")
@_common
@click.pass_obj
def requeue(ctx: Context, key: str, publish: bool) -> None:
    """Bring a dead lease back (ready, fresh attempts) and re-publish its task."""
    with ctx.store() as store:
        try:
            done = _operations(ctx, store).requeue(key, reason="requeued by an operator",
                                                   publish=publish)
        except Refusal as exc:
            _fail(ctx, str(exc))
    _unrecorded(done)
    if done.publish_error is not None:
        if done.record is None or done.record.task is None:
            _fail(ctx, f"lease {key!r} is ready again, but its task cannot be re-published "
                       "(none is recorded on it): publish it yourself")
        _fail(ctx, f"lease {key!r} is ready again, but its task could not be re-published "
                   f"({done.publish_error}); a worker's sweeper re-publishes it "
                   "after lease_sweep_grace (or run celery leases sweep)")
    published = done.task_id
    _emit(ctx, {"requeued": key, "task_id": published},
          f"requeued {_printable(key)}" + (f"; task {published} published" if published else ""))


@leases.command()
@click.option("--older-than", "older_than", required=True, metavar="DURATION",
              help="Purge done/dead leases not changed for this long (e.g. 7d).")
@_common
@click.pass_obj
def purge(ctx: Context, older_than: str) -> None:
    """Delete old done/dead leases; their tokens are kept, so keys never restart their count."""
    seconds = parse_duration(older_than)
    with ctx.store() as store:
        done = _operations(ctx, store).purge(seconds)
    _unrecorded(done)
    _emit(ctx, {"purged": done.count}, f"purged {done.count} lease(s)")


@leases.command()
@_common
@click.pass_obj
def stats(ctx: Context) -> None:
    """Count leases by state."""
    with ctx.store() as store:
        figures = store.stats()
    counts = {state.value: figures.counts.get(state.value, 0) for state in LeaseState}
    data = {"counts": counts, "expired": figures.expired, "total": figures.total}
    text = "\n".join(f"{state:>8}: {count}" for state, count in counts.items())
    _emit(ctx, data, f"{text}\n expired: {figures.expired} (running, lease run out)")


@leases.command(name="sweep")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@_common
@click.pass_obj
def sweep_(ctx: Context, limit: int) -> None:
    """Re-publish the tasks of leases that nobody will run otherwise (expired, settling past
    their deadline, ready and unclaimed, limit waiters with a free slot); exit 1 when a
    re-publish failed."""
    with ctx.store() as store:
        report = sweep_report(ctx.app, store, limit=limit)
    for record, why in report.failed:
        click.echo(f"lease {_printable(record.key)}: its task could not be re-published "
                   f"({_one_line(why)}); the next sweep tries again", err=True)
    for record in report.no_task:
        click.echo(f"lease {_printable(record.key)}: no task is recorded on it to re-publish",
                   err=True)
    _emit(ctx, {"swept": [r.key for r in report.republished],
                "failed": [r.key for r, _ in report.failed],
                "no_task": [r.key for r in report.no_task],
                "handed_on": [w.key for w in report.handed_on]},
          f"re-published {len(report.republished)} task(s)"
          + (f"; {len(report.failed)} failed" if report.failed else "")
          + (f"; {len(report.handed_on)} limit waiter(s) handed on" if report.handed_on
             else ""))
    if report.failed:
        sys.exit(1)


def _lift_or(value: str | None, parse: Callable[[str], Any]) -> Any:
    """An option of ``leases limit``: None when not given, False for ``none`` (lift it),
    else ``parse(value)``; a value it refuses is a usage error."""
    if value is None:
        return None
    if value.strip().lower() in ("none", "off"):
        return False
    try:
        return parse(value.strip())
    except ConfigError as exc:
        _refuse(f"{exc}, or none to lift it")


def _group_line(group: LimitGroup) -> str:
    limit = "-" if group.limit is None else str(group.limit)
    rate = group.rate or "-"
    note = (f"  (operator's {' and '.join(group.overridden)})" if group.overridden
            else "")
    return (f"{_printable(group.group)}  limit {limit}  rate {rate}  running {group.running}"
            f"  waiting {group.waiting}{note}")


@leases.command()
@click.option("--limit", "max_groups", type=click.IntRange(min=1), default=100,
              show_default=True, help="List at most this many groups.")
@_common
@click.pass_obj
def limits(ctx: Context, max_groups: int) -> None:
    """List the key-group limits: each group's limit and rate in force, running and waiting."""
    with ctx.store() as store:
        groups = store.limits(limit=max_groups)
    _emit(ctx, [asdict(group) for group in groups],
          "\n".join(_group_line(group) for group in groups) or "no limit groups")


@leases.command()
@click.argument("group")
@click.option("--limit", "new_limit", metavar="N|none",
              help="At most N of the group run at once (none: no limit).")
@click.option("--rate", "new_rate", metavar="R|none",
              help="At most R starts (10/s, 100/m, 5/h; none: no rate).")
@click.option("--reset", is_flag=True, help="Back to the limit and rate the tasks ask for.")
@_common
@click.pass_obj
def limit(ctx: Context, group: str, new_limit: str | None, new_rate: str | None,
          reset: bool) -> None:
    """Change a group's limit or rate without a deploy; waiters a raised limit lets run are
    published at once."""
    concurrency = _lift_or(new_limit, lambda v: check_concurrency(v, name="--limit"))
    rate_value = _lift_or(new_rate, lambda v: parse_rate(v, name="--rate").text)
    if concurrency is None and rate_value is None and not reset:
        _refuse("give --limit N, --rate R or --reset (see celery leases limits)")
    with ctx.store() as store:
        try:
            done = _operations(ctx, store).limit(group, concurrency=concurrency,
                                                 rate=rate_value, reset=reset)
        except Refusal as exc:
            _refuse(str(exc))
    _unrecorded(done)
    found, handed = done.group, done.handed_on
    assert found is not None
    _emit(ctx, {**asdict(found), "handed_on": [w.key for w in handed]},
          _group_line(found) + (f"; {len(handed)} waiter(s) published" if handed else ""))


def _receipt_line(receipt: Receipt, now: float) -> tuple[str, ...]:
    lease = ("-" if receipt.lease_key is None
             else f"{receipt.lease_key} (token {receipt.lease_token})")
    return (_printable(receipt.key), receipt.state.value, str(receipt.attempts),
            _printable(lease), _age(receipt.updated_at, now))


@leases.group(invoke_without_command=True)
@click.option("--state", type=click.Choice([s.value for s in EffectState]),
              help="Only receipts in this state (needs_reconciliation: the ones to reconcile).")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@_common
@click.pass_context
def effects(click_ctx: click.Context, state: str | None, limit: int) -> None:
    """List effect receipts, most recently changed first; reconcile one whose outcome is
    unknown with `effects resolve KEY --result JSON` (it happened) or `effects discard KEY`
    (it did not)."""
    if click_ctx.invoked_subcommand is not None:
        return
    ctx = click_ctx.find_object(Context)
    assert ctx is not None
    with ctx.store() as store:
        receipts = store.effects.find(None if state is None else EffectState(state),
                                      limit=limit)
        now = store.now()
    header = ("KEY", "STATE", "ATTEMPTS", "LEASE", "CHANGED")
    rows = [header, *(_receipt_line(r, now) for r in receipts)]
    widths = [max(len(c) for c in col) for col in zip(*rows, strict=True)]
    _emit(ctx, [{**asdict(r), "state": r.state.value} for r in receipts],
          "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                    for row in rows))


def _json_argument(_: click.Context, __: click.Parameter, value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"{value!r} is not JSON ({exc})") from exc


@effects.command()
@click.argument("key")
@click.option("--result", required=True, metavar="JSON", callback=_json_argument,
              help="What the action returned (as found at the target): replays return it.")
@_common
@click.pass_obj
def resolve(ctx: Context, key: str, result: Any) -> None:
    """Record that the receipt's action happened, with its result (refused while an attempt
    is still running under a current lease)."""
    with ctx.store() as store:
        try:
            done = _operations(ctx, store).resolve(key, result)
        except Refusal as exc:
            _fail(ctx, str(exc))
    _unrecorded(done)
    _emit(ctx, {"resolved": key, "result": result},
          f"resolved {_printable(key)}: replays return {json.dumps(result)}")


@effects.command()
@click.argument("key")
@_common
@click.pass_obj
def discard(ctx: Context, key: str) -> None:
    """Remove the receipt (its action did not happen): the next attempt performs it."""
    with ctx.store() as store:
        try:
            done = _operations(ctx, store).discard(key)
        except Refusal as exc:
            _fail(ctx, str(exc))
    _unrecorded(done)
    _emit(ctx, {"discarded": key},
          f"discarded {_printable(key)}: the next attempt performs the action")


#: What an operator accepts with ``reset-epoch``, said before and after the reset.
RESET_EPOCH_RISKS = (
    "what the store lost stays lost: a key whose row vanished is granted to its next "
    "delivery, so a task whose lease was running, or that had finished, may run again; an "
    "effect whose receipt vanished may be sent again (a receipt kept in flight says "
    "'outcome unknown: reconcile'); workers that held leases lose them at their next renewal. "
    "Tokens and fence numbers continue above every number handed out before")


@leases.command(name="reset-epoch")
@click.option("--accept-data-loss", "accept", is_flag=True,
              help="Required: start a new epoch, accepting what the store lost.")
@_common
@click.pass_obj
def reset_epoch(ctx: Context, accept: bool) -> None:
    """Start the store's new epoch after its server lost data (StoreDataLost: nothing is
    granted until then). Says what may run twice."""
    if not accept:
        _refuse("reset-epoch needs --accept-data-loss: " + RESET_EPOCH_RISKS)
    with ctx.store() as store:
        try:
            reset = _operations(ctx, store).reset_epoch()
        except Refusal as exc:  # a store that keeps no epoch
            _fail(ctx, str(exc))
    _unrecorded(reset)
    done = reset.epoch
    assert done is not None
    before = (f"replaced epoch {done.replaced}" if done.replaced else "no epoch record was left")
    if done.lost:
        before += f" (marked lost: {_printable(done.lost)})"
    _emit(ctx, {"epoch": done.epoch.id, "floor": done.epoch.floor,
                "created_at": done.epoch.created_at, "replaced": done.replaced,
                "lost": done.lost, "may_run_twice": RESET_EPOCH_RISKS},
          f"new epoch {done.epoch.id}: tokens continue above {done.epoch.floor}; {before}.\n"
          f"Accepted: {RESET_EPOCH_RISKS}.")


@leases.command()
@_common
@click.pass_obj
def doctor(ctx: Context) -> None:
    """Check the app's broker, task and lease settings against each other (with --store:
    that store instead of the one the settings name); exit 1 on an error."""
    findings = diagnose(ctx.app, store_url=ctx.store_override, import_error=ctx.load_error)
    marks = {"error": "ERROR", "warning": "warn ", "ok": "ok   "}
    lines = []
    for promise in ("delivery", "ownership", "effects"):
        mine = [f for f in findings if f.promise == promise]
        if mine:
            lines.append(f"{promise}:")
            lines += [f"  {marks[f.severity]} [{f.code}] {_printable(f.message)}"
                      for f in mine]
    _emit(ctx, [f.as_dict() for f in findings], "\n".join(lines))
    if any(f.severity == "error" for f in findings):
        sys.exit(1)


@leases.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; beyond loopback only with --token.")
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True,
              help="Port to listen on (0: any free port, printed at start).")
@click.option("--token", envvar="LEASE_WEB_TOKEN", metavar="T",
              help="Operator token that actions need (or $LEASE_WEB_TOKEN, which keeps it out "
                   "of ps); without it the dashboard is read-only.")
@click.option("--protect-reads/--open-reads", default=None,
              help="Every page, not only every action, needs the token (a browser signs in "
                   "once per session). Default: on beyond loopback, off on it.")
@_common
@click.pass_obj
def web(ctx: Context, host: str, port: int, token: str | None,
        protect_reads: bool | None) -> None:
    """Serve the web dashboard (counts, running, takeovers, dead keys, reconciliation, one
    page per key) until Ctrl-C."""
    from .web.serve import serve

    try:
        serve(ctx.store_url, host=host, port=port, token=token, app=ctx.app,
              protect_reads=protect_reads,
              announce=lambda line: click.echo(line, err=line.startswith("WARNING")))
    except ConfigError as exc:
        _refuse(str(exc))


def _fail(ctx: Context, message: str) -> NoReturn:
    if ctx.as_json:
        click.echo(json.dumps({"error": message}))
    else:
        click.echo(_printable(_one_line(message)), err=True)
    sys.exit(1)


class _AppNotLoaded(LeaseError):
    """Unable to load celery application."""


class _Loaded:
    """What ``python -m lease_celery`` hands the commands, as Celery's program hands its
    ``CLIContext``: the app (None when not named) and why it did not import."""

    def __init__(self, app: Any, load_error: BaseException | None) -> None:
        self.app, self.load_error = app, load_error


def _load_app(name: str) -> _Loaded:
    """Import the app as ``celery -A`` does, with its words for a module that is missing;
    any other error in the module in one line (``doctor`` reports it as a finding)."""
    from celery.app.utils import find_app

    sys.path.insert(0, "")
    module = name.partition(":")[0]
    try:
        return _Loaded(find_app(name), None)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module == exc.name or module.startswith(exc.name + ".")):
            error = _AppNotLoaded(f"Unable to load celery application. The module "
                                  f"{exc.name} was not found.")
        else:
            error = _AppNotLoaded(_load_failure(module, exc))
        error.__cause__ = exc
    except Exception as exc:  # the module itself raised: its author's error, not ours
        error = _AppNotLoaded(_load_failure(module, exc))
        error.__cause__ = exc
    return _Loaded(None, error)


def _load_failure(module: str, exc: BaseException) -> str:
    detail = " ".join(str(exc).split())
    return (f"Unable to load celery application. While trying to load the module {module} "
            f"the following error occurred: {type(exc).__name__}: {detail}")


@click.group(name="lease_celery", commands=leases.commands)
@click.option("-A", "--app", "app_name", metavar="APP", help="The Celery app, as for celery -A.")
@click.option("--store", "store_url", metavar="URL",
              help="Lease store URL (default: the app's lease_store_url).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def main(click_ctx: click.Context, app_name: str | None, store_url: str | None,
         as_json: bool) -> None:
    """python -m lease_celery -A APP [--store URL] [--json] COMMAND …: the celery leases
    commands without the celery program."""
    click_ctx.obj = _load_app(app_name) if app_name else _Loaded(None, None)
    _start(click_ctx, store_url, as_json)
