"""mkdocs hook (``hooks:`` in mkdocs.yml): the ``lease_*`` settings table, rendered at build time.

Where each setting may be set comes from lease_celery itself (``lease_celery.names``: the sets
doctor checks names against), and so do the defaults that are constants in
``lease_celery.settings``; this file holds only what code cannot say: a default that is a rule
("lease_ttl / 3") and the meaning. A setting lease_celery reads but this table lacks, or a row
for a name it does not read, fails the build (and tests/unit/test_docs_settings.py).

A page asks for the table with the line ``<!-- lease-settings-table -->``.
"""

from __future__ import annotations

from typing import Any

MARKER = "<!-- lease-settings-table -->"

#: Options of a task that are not ``lease_*`` names (``lease_celery.settings`` reads them from
#: the task only), documented in the same table.
TASK_ONLY_EXTRA = frozenset({"permanent_errors"})

#: name -> (default, meaning). A default may name constants of lease_celery.settings in braces
#: (``{DEFAULT_TTL:g}``; the failure policy's defaults by their short names, ``{max_attempts}``).
#: Names sharing a row are joined by ", " in one key.
ROWS: dict[str, tuple[str, str]] = {
    "lease_store_url": (
        "`{DEFAULT_STORE_URL}` (in the working directory)",
        "`sqlite:////absolute/path.sqlite3`, `sqlite:///relative` (to each process's working "
        "directory: `doctor` warns), `sqlite://` (in memory, one process), `postgresql://…`, "
        "`redis://…` ([Stores](../stores.md))"),
    "lease_ttl": ("`{DEFAULT_TTL:g}`", "seconds a claim or renewal holds the lease"),
    "lease_heartbeat_interval": (
        "`lease_ttl / 3`", "seconds between renewals; must be below `lease_ttl`"),
    "lease_key": (
        "the task id",
        "`\"report:{{report_id}}\"` (a format string over the task's arguments), or a callable "
        "taking the task's arguments"),
    "lease_unique": (
        "`False`",
        "`True`: `apply_async` returns the `AsyncResult` of the delivery that holds, waits to "
        "retry or finished the key, and publishes nothing (also per call: "
        "`apply_async(..., lease_unique=True)`; [Unique at enqueue](../brokers.md#unique))"),
    "lease_retry_errors": (
        "`False`",
        "`True`: a body's exception is retried by the lease with a backoff, up to "
        "`lease_max_attempts`; by default it fails the task at once, as in Celery (Celery's "
        "own `self.retry`, `autoretry_for` and `max_retries` work either way)"),
    "lease_max_attempts": (
        "`{max_attempts:g}`",
        "with `lease_retry_errors`: claims of one key that may fail (takeovers included) "
        "before it goes `dead`; a Celery retry or a `replace()` gives its attempt back"),
    "lease_max_takeovers": (
        "`{max_takeovers:g}`",
        "times the worker running it may be lost (SIGKILL, OOM) before it goes `dead`"),
    "lease_backoff_base, lease_backoff_max": (
        "`{backoff_base:g}`, `{backoff_max:g}`",
        "seconds: backoff after attempt n is `min(max, base·2ⁿ⁻¹)`, with equal jitter"),
    "permanent_errors": (
        "`()`",
        "with `lease_retry_errors`: exception classes that go `dead` at once (added to the "
        "built-in ones: non-JSON result or payload, bad key, effect conflict or unknown "
        "outcome, `MaxRetriesExceededError`)"),
    "lease_sweep_interval": (
        "half the smallest `lease_ttl`",
        "seconds between the workers' sweeps; `0` turns it off "
        "([The sweeper](../operations.md#the-sweeper))"),
    "lease_sweep_grace": (
        "`{DEFAULT_SWEEP_GRACE:g}`",
        "seconds: a ready row unclaimed this long after it became claimable is re-published, "
        "and no row is re-published twice within it"),
    "lease_extend_visibility": (
        "`False`",
        "`True`: on SQS and Redis brokers the worker keeps a running task's message from being "
        "handed out again while its lease is renewed "
        "([Extending the visibility](../brokers.md#extend-visibility))"),
    "lease_record_at_publish": (
        "`False`",
        "`True`: `apply_async` writes the key's row (`ready`, with the message) before "
        "publishing, so a message the broker loses is re-published by the sweeper (also per "
        "call: `apply_async(..., lease_record=True)`; "
        "[A row from the moment of publish](../brokers.md#record-at-publish))"),
    "lease_limit": (
        "off",
        "at most this many executions of the task's group run at once, across every worker; the "
        "rest wait on the store, their messages acked ([Key-group limits](../limits.md))"),
    "lease_rate_limit": (
        "off",
        "at most this many starts of the group per period, across every worker: Celery's "
        "format, `\"10/s\"`, `\"100/m\"`, `\"5/h\"`"),
    "lease_limit_key": (
        "the task's name",
        "the group, given like `lease_key`: `\"tenant:{{tenant_id}}\"` or a callable; tasks of "
        "different names may share one"),
    "lease_recovery_priority": (
        "`\"auto\"`",
        "the message priority of recovered work (re-published by the sweeper, the time-limit "
        "handler, or a delivery whose lease lapsed or whose store did not answer): `\"auto\"` "
        "takes the broker's first (Redis: `0`; RabbitMQ: the queue's `x-max-priority`), a "
        "number is used as it is, `False` keeps the priority the work was published with "
        "([Recovered work](../brokers.md#recovery-priority))"),
    "lease_retention": (
        "`{DEFAULT_RETENTION:.0f}` (7 days)",
        "seconds a settled `done`/`dead` row is kept; the sweeper prunes older ones, oldest "
        "first, 100 per sweep in one short write; `0` keeps them forever. Tokens never restart"),
    "lease_retry_time_limits": (
        "`False`",
        "`True`: Celery's soft and hard time limits are retried by the policy instead of ending "
        "the key `dead` ([Time limits](../long-work.md#time-limits))"),
    "lease_finish_in_background": (
        "`\"auto\"`",
        "a task whose outcome Celery neither stores nor sends on returns without waiting for "
        "its finish, which a heartbeat thread writes: `True` always, `False` never, `\"auto\"` "
        "when the body ran at least {BACKGROUND_AFTER_MS:g} ms "
        "([Fire-and-forget tasks](../guarantees.md#fire-and-forget-tasks))"),
    "lease_metrics_port, lease_metrics_addr": (
        "off, `127.0.0.1`",
        "serve Prometheus metrics from the worker's main process "
        "([Metrics](../observability.md#metrics))"),
}

SCOPES = {"task_or_app": "app, or per task", "task": "task option only", "app": "app-wide only"}


def scopes() -> dict[str, str]:
    """Every name lease_celery reads -> ``task_or_app`` | ``task`` | ``app``, from
    ``lease_celery.names`` (what doctor checks settings and task options against)."""
    from lease_celery import names

    found = {name: "task_or_app" for name in names.TASK_OR_APP}
    found.update({name: "task" for name in names.TASK_ONLY | TASK_ONLY_EXTRA})
    found.update({name: "app" for name in names.APP_ONLY})
    return found


def documented() -> list[str]:
    """Every name the table has a row for, in the table's order."""
    return [name for key in ROWS for name in key.split(", ")]


def problems() -> list[str]:
    """How the table and what lease_celery reads differ (empty when they agree)."""
    known, rows = scopes(), documented()
    found = [f"{name}: lease_celery reads it, the settings table has no row for it"
             for name in sorted(set(known) - set(rows))]
    found += [f"{name}: a row of the settings table, but lease_celery does not read it"
              for name in sorted(set(rows) - set(known))]
    found += [f"{name}: on the table twice" for name in sorted(set(rows))
              if rows.count(name) > 1]
    for key in ROWS:
        where = {known.get(name) for name in key.split(", ")}
        if len(where) > 1:
            found.append(f"{key}: one row, but not one scope ({sorted(map(str, where))})")
    return found


def _defaults() -> dict[str, Any]:
    from lease_celery import settings

    values: dict[str, Any] = {name: getattr(settings, name) for name in dir(settings)
                              if name.isupper()}
    values.update(settings.POLICY_DEFAULTS)
    values["BACKGROUND_AFTER_MS"] = settings.BACKGROUND_AFTER * 1000
    return values


def render() -> str:
    """The table, in Markdown: setting | where | default | meaning."""
    found = problems()
    if found:
        raise ValueError("the settings table and lease_celery disagree: " + "; ".join(found))
    known, values = scopes(), _defaults()
    lines = ["| setting | where | default | meaning |", "| --- | --- | --- | --- |"]
    for key, (default, meaning) in ROWS.items():
        first = key.split(", ")[0]
        shown = ", ".join(f"`{name}`" for name in key.split(", "))
        lines.append(f"| {shown} | {SCOPES[known[first]]} | {default.format_map(values)} | "
                     f"{meaning.format_map(values)} |")
    return "\n".join(lines)


def on_page_markdown(markdown: str, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    try:
        table = render()
    except ValueError as exc:
        from mkdocs.exceptions import PluginError

        raise PluginError(str(exc)) from exc
    return markdown.replace(MARKER, table)
