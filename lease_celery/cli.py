"""``celery -A proj leases …`` and ``python -m lease_celery -A proj …``: see and act on leases.

Exit codes: 0 done; 1 the key is missing or not in a state that allows the action, or
``doctor`` found an error; 2 bad usage. ``--json`` prints machine-readable output.
"""

from __future__ import annotations

import getpass
import json
import re
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import click

from .delivery import republish
from .doctor import diagnose
from .errors import ConfigError, LeaseError
from .models import HistoryEntry, LeaseRecord, LeaseState
from .settings import resolve_settings
from .stores.base import Store, open_store
from .sweeper import sweep

__all__ = ["leases", "main"]

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw]?)$")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``12h``, ``7d``, ``2w`` → seconds."""
    match = _DURATION.match(text.strip())
    if match is None:
        raise click.BadParameter(f"{text!r} is not a duration such as 30s, 15m, 12h or 7d")
    return float(match.group(1)) * _UNIT[match.group(2)]


class Context:
    """What every sub-command needs: the app (if any) and the store URL."""

    def __init__(self, app: Any, store_url: str | None, as_json: bool) -> None:
        self.app, self.as_json = app, as_json
        self._store_url = store_url

    @property
    def store_url(self) -> str:
        if self._store_url:
            return self._store_url
        if self.app is None:
            raise click.UsageError("name the app (-A proj) or the store (--store URL)")
        return resolve_settings(self.app).store_url

    @contextmanager
    def store(self) -> Iterator[Store]:
        try:
            with open_store(self.store_url) as store:
                yield store
        except LeaseError as exc:
            raise click.ClickException(str(exc)) from exc


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
    """See and act on lease_celery leases."""
    celery_ctx = click_ctx.obj
    app = getattr(celery_ctx, "app", None) if celery_ctx is not None else None
    click_ctx.obj = Context(app, store_url, as_json)


@leases.command(name="list")
@click.option("--state", type=click.Choice([s.value for s in LeaseState]))
@click.option("--prefix", help="Only keys starting with this.")
@click.option("--owner", help="Only leases of this owner: an execution (hostname:pid:uuid/n) "
              "or every execution of a process (hostname:pid:uuid).")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@click.pass_obj
def list_(ctx: Context, state: str | None, prefix: str | None, owner: str | None,
          limit: int) -> None:
    """List leases, most recently changed first."""
    with ctx.store() as store:
        records = store.find(state=None if state is None else LeaseState(state), prefix=prefix,
                             owner=owner, limit=limit)
        now = store.now()
    rows = [(r.key, r.state.value, str(r.token), f"{r.attempts}/{r.takeovers}",
             _age(r.expires_at, now) if r.state is LeaseState.RUNNING else "-",
             r.owner or "-") for r in records]
    header = ("KEY", "STATE", "TOKEN", "TRIES/TAKEOVERS", "EXPIRES", "OWNER")
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in (header, *rows)]
    _emit(ctx, [_record_dict(r) for r in records], "\n".join(lines))


@leases.command()
@click.argument("key")
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
    data["history"] = [asdict(entry) for entry in recent]
    text = "\n".join(f"{name:>11}: {_show_value(name, value, now)}"
                     for name, value in data.items() if name != "history")
    lines = [_history_line(entry, now) for entry in recent] or ["(none yet)"]
    _emit(ctx, data, text + f"\n    history (last {SHOW_HISTORY}; `history KEY` for all):\n"
          + "\n".join(f"      {line}" for line in lines))


@leases.command()
@click.argument("key")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
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
    return f"{when} UTC ({_age(entry.at, now)}) {entry.event}{token}{who}{detail}"


def _operator(ctx: Context, store: Store, key: str, action: str, detail: str) -> None:
    """Record an operator's action in the key's history: what, and who (user, host)."""
    who = f"{getpass.getuser()}@{socket.gethostname()} via the CLI"
    store.record_history(key, f"operator:{action}", detail=f"{who}: {detail}")


def _show_value(name: str, value: Any, now: float) -> str:
    if name in ("expires_at", "updated_at", "not_before") and isinstance(value, float):
        return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(value))} UTC " \
               f"({_age(value, now)})"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return "-" if value is None else str(value)


@leases.command()
@click.argument("key")
@click.option("--reason", default="released by an operator", show_default=True)
@click.pass_obj
def release(ctx: Context, key: str, reason: str) -> None:
    """Make a running lease ready, whoever holds it (its holder's result is then refused)."""
    with ctx.store() as store:
        done = store.force_release(key, reason=reason)
        record = store.get(key)
        if done:
            _operator(ctx, store, key, "release", reason)
    if not done:
        _fail(ctx, f"lease {key!r} is not running ({record.state.value if record else 'none'})")
    _emit(ctx, {"released": key}, f"released {key}")


@leases.command()
@click.argument("key")
@click.option("--reason", default="by an operator", show_default=True)
@click.pass_obj
def cancel(ctx: Context, key: str, reason: str) -> None:
    """Cancel a key: a running holder stops at its next heartbeat, a key not yet started never
    runs; it ends dead ("cancelled: REASON") until requeued."""
    with ctx.store() as store:
        done = store.cancel(key, reason=reason)
        record = store.get(key)
        if done:
            _operator(ctx, store, key, "cancel", reason)
    if not done:
        _fail(ctx, f"lease {key!r} is {record.state.value if record else 'none'}: nothing to "
                   f"cancel")
    assert record is not None
    how = ("its holder stops at its next heartbeat" if record.state is LeaseState.RUNNING
           else "it will not run")
    _emit(ctx, {"cancelled": key, "state": record.state.value, "reason": record.cancel},
          f"cancelled {key}: {how} ({record.cancel})")


@leases.command()
@click.argument("key")
@click.option("--publish/--no-publish", default=True, show_default=True,
              help="Re-publish the task recorded on the lease.")
@click.pass_obj
def requeue(ctx: Context, key: str, publish: bool) -> None:
    """Bring a dead lease back (ready, fresh attempts) and re-publish its task."""
    with ctx.store() as store:
        record = store.requeue(key, reason="requeued by an operator")
        if record is not None:
            _operator(ctx, store, key, "requeue", "dead -> ready")
    if record is None:
        _fail(ctx, f"lease {key!r} is not dead")
    assert record is not None
    published = None
    if publish:
        if ctx.app is None or record.task is None:
            _fail(ctx, f"lease {key!r} is ready again, but its task cannot be re-published "
                       "(no app given, or no task recorded): publish it yourself")
        assert record.task is not None
        # A fresh start: Celery's retry count begins again, like the lease's attempts.
        published = republish(ctx.app, record.task, retries=0).id
    _emit(ctx, {"requeued": key, "task_id": published},
          f"requeued {key}" + (f"; task {published} published" if published else ""))


@leases.command()
@click.option("--older-than", "older_than", required=True, metavar="DURATION",
              help="Purge done/dead leases not changed for this long (e.g. 7d).")
@click.pass_obj
def purge(ctx: Context, older_than: str) -> None:
    """Delete old done/dead leases; their tokens are kept, so keys never restart at 1."""
    seconds = parse_duration(older_than)
    with ctx.store() as store:
        count = store.purge_older_than(seconds)
    _emit(ctx, {"purged": count}, f"purged {count} lease(s)")


@leases.command()
@click.pass_obj
def stats(ctx: Context) -> None:
    """Count leases by state."""
    with ctx.store() as store:
        figures = store.stats()
    data = {"counts": figures.counts, "expired": figures.expired, "total": figures.total}
    text = "\n".join(f"{state:>8}: {figures.counts.get(state, 0)}"
                     for state in [s.value for s in LeaseState])
    _emit(ctx, data, f"{text}\n expired: {figures.expired} (running, lease run out)")


@leases.command(name="sweep")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@click.pass_obj
def sweep_(ctx: Context, limit: int) -> None:
    """Re-publish the tasks of leases that expired without renewal."""
    if ctx.app is None:
        raise click.UsageError("sweep publishes tasks: name the app with -A")
    with ctx.store() as store:
        swept = sweep(ctx.app, store, limit=limit)
    _emit(ctx, {"swept": [r.key for r in swept]}, f"re-published {len(swept)} task(s)")


@leases.command()
@click.pass_obj
def doctor(ctx: Context) -> None:
    """Check the app's broker, task and lease settings against each other."""
    if ctx.app is None:
        raise click.UsageError("doctor reads the app's configuration: name it with -A")
    findings = diagnose(ctx.app)
    marks = {"error": "ERROR", "warning": "warn ", "ok": "ok   "}
    lines = []
    for promise in ("delivery", "ownership", "effects"):
        mine = [f for f in findings if f.promise == promise]
        if mine:
            lines.append(f"{promise}:")
            lines += [f"  {marks[f.severity]} [{f.code}] {f.message}" for f in mine]
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
@click.pass_obj
def web(ctx: Context, host: str, port: int, token: str | None) -> None:
    """Serve the web dashboard (counts, running, takeovers, dead keys, reconciliation, one
    page per key) until Ctrl-C."""
    from .web.serve import serve

    try:
        serve(ctx.store_url, host=host, port=port, token=token, app=ctx.app,
              announce=lambda line: click.echo(line, err=line.startswith("WARNING")))
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc


def _fail(ctx: Context, message: str) -> None:
    if ctx.as_json:
        click.echo(json.dumps({"error": message}))
    else:
        click.echo(message, err=True)
    sys.exit(1)


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("-A", "--app", "app_name", metavar="APP", help="The Celery app, as for celery -A.")
@click.pass_context
def main(click_ctx: click.Context, app_name: str | None) -> None:
    """python -m lease_celery [-A APP] [--store URL] [--json] COMMAND …"""
    app = None
    if app_name:
        from celery.app.utils import find_app

        sys.path.insert(0, "")
        app = find_app(app_name)

    class _Obj:
        pass

    obj = _Obj()
    obj.app = app  # type: ignore[attr-defined]
    leases.main(args=click_ctx.args, prog_name="python -m lease_celery", obj=obj)
