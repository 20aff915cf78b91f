"""The checks of the transactional variants (pure, like the rest of the checker): what the
app's own tables must show once a run settled.

``app_rows`` (``app-tx``, ``enqueue-tx``)
    A done job key has exactly one app row; a key that is not done has none. A second row is
    a body whose writes committed twice (two owners, or one owner's retry after its commit);
    a row on a key not done is writes committed without the finish.
``stale_app_row``
    The one app row of a done key carries the row's final token (the accepted owner's), and
    the key's accepted result is that owner's (same token): no stale owner's row committed.
``rolled_back_ran`` (``enqueue-tx``)
    An order whose transaction did not commit left nothing: no lease row, no app row, no
    receiver request, and no worker ever received or ran its task.
``order_mismatch`` (``enqueue-tx``)
    An order row and its key's lease row committed together: neither without the other.
``order_payment`` (``django-tx``)
    Each order row has exactly one payment, of the order's token: the block's model writes
    (the payment in a savepoint of it) committed together, never one without the other.

In ``django-tx`` the app rows are the Django ``Order`` rows (``djangodb.py``), so ``app_rows``
and ``stale_app_row`` judge them: one order per done key, none for a key not done, its token
the key's final one (which ``stale_accepted`` ties to the accepted finish's).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from .config import DJANGO_VARIANT, TX_VARIANTS, effect_key, job_key
from .history import History

__all__ = ["TX_CHECKS", "VARIANT_CHECKS", "tx_counts", "tx_violations"]

TX_CHECKS = {
    "app_rows": "a done key without exactly one app row, or an app row on a key not done",
    "stale_app_row": "an app row (or accepted result) of a token not the key's final one",
    "rolled_back_ran": "a rolled-back order whose job left a row, a request or a run",
    "order_mismatch": "an order row without its key's lease row, or the other way round",
    "order_payment": "an order row without exactly one payment of its token",
}
#: The checks above each transactional variant is judged by (and its table shows).
VARIANT_CHECKS = {
    "app-tx": ("app_rows", "stale_app_row"),
    "enqueue-tx": ("app_rows", "stale_app_row", "rolled_back_ran", "order_mismatch"),
    DJANGO_VARIANT: ("app_rows", "stale_app_row", "order_payment"),
}

Finding = tuple[str, str, str]  # (check, subject, detail): the checker makes it a Violation


def tx_violations(history: History) -> list[Finding]:
    if history.variant not in TX_VARIANTS:
        return []
    found = _app_rows(history)
    if history.variant == "enqueue-tx":
        found += _rolled_back_ran(history) + _order_mismatch(history)
    if history.variant == DJANGO_VARIANT:
        found += _order_payment(history)
    return found


def _job_keys(history: History) -> set[str]:
    """The lease rows of jobs (``job:<job>``; not the library's own rows beside them, such as
    a duplicate's answer ``job:<job>#answer:<id>``)."""
    return {k for k in history.rows if k.startswith("job:") and "#" not in k}


def _jobs(history: History) -> set[str]:
    return ({p.job for p in history.published} | set(history.app_rows) | set(history.orders)
            | {k.removeprefix("job:") for k in _job_keys(history)})


def _token(result: Any) -> Any:
    return result.get("token") if isinstance(result, dict) else None


def _app_rows(history: History) -> list[Finding]:
    found: list[Finding] = []
    for job in sorted(_jobs(history)):
        key, rows = job_key(job), history.app_rows.get(job, [])
        row = history.rows.get(key)
        done = row is not None and row.state == "done"
        tokens = [r["token"] for r in rows]
        if (done and len(rows) != 1) or (not done and rows):
            state = "no row" if row is None else f"{row.state} token {row.token}"
            found.append(("app_rows", key, f"key {state}, app rows of tokens {tokens}"))
            continue
        if done and row is not None and (tokens[0] != row.token
                                         or _token(row.result) != row.token):
            found.append(("stale_app_row", key,
                          f"key done with token {row.token} and result {row.result!r}, "
                          f"app row of token {tokens[0]} (pid {rows[0].get('pid')})"))
    return found


def _not_committed(history: History) -> set[str]:
    """Jobs a publisher began whose order is not in the database."""
    begun = {str(e["job"]) for e in history.events if e.get("event") == "order"}
    return begun - set(history.orders)


def _rolled_back_ran(history: History) -> list[Finding]:
    found: list[Finding] = []
    dropped = _not_committed(history)
    ids = {str(e["task_id"]): str(e["job"]) for e in history.events
           if e.get("event") == "order" and str(e["job"]) in dropped}
    traces: dict[str, list[str]] = {job: [] for job in dropped}
    for job in dropped:
        if job_key(job) in history.rows:
            traces[job].append(f"lease row {history.rows[job_key(job)].state}")
        if history.app_rows.get(job):
            traces[job].append("app row")
    for request in history.received:
        job = str(request.get("idempotency_key", "")).removeprefix("send:")
        if job in dropped and effect_key(job) == request.get("idempotency_key"):
            traces[job].append("receiver request")
    for event in history.events:
        ran = ids.get(str(event.get("task_id")))
        if ran is not None and event.get("event") in ("task_received", "body_start"):
            traces[ran].append(f"{event['event']} pid {event.get('pid')}")
    for job, seen in sorted(traces.items()):
        if seen:
            found.append(("rolled_back_ran", job_key(job),
                          f"its order did not commit, yet: {', '.join(seen)}"))
    return found


def _order_mismatch(history: History) -> list[Finding]:
    keys = _job_keys(history)
    ordered = {job_key(job) for job in history.orders}
    return ([("order_mismatch", key, "an order row, no lease row") for key in
             sorted(ordered - keys)]
            + [("order_mismatch", key, "a lease row, no order row") for key in
               sorted(keys - ordered)])


def _order_payment(history: History) -> list[Finding]:
    found: list[Finding] = []
    for job, rows in sorted(history.app_rows.items()):
        for row in rows:
            payments = list(row.get("payments", []))
            if payments != [row["token"]]:
                found.append(("order_payment", job_key(job),
                              f"order of token {row['token']} (pid {row.get('pid')}) with "
                              f"payments of tokens {payments}"))
    return found


def tx_counts(history: History) -> dict[str, Any]:
    """Table rows of the transactional variants."""
    if history.variant not in TX_VARIANTS:
        return {}
    counts: dict[str, Any] = {
        "app rows": sum(len(rows) for rows in history.app_rows.values()),
        "app transactions retried (broken connection)": sum(
            1 for e in history.events if e.get("event") == "app_tx_retry"),
    }
    exits = [e for e in history.events
             if e.get("event") == "fault" and e.get("kind") == "commit_exit"]
    counts["bodies run again after a kill between commit and ack"] = sum(
        1 for e in history.events for fault in exits
        if e.get("event") == "body_start" and e.get("key") == fault.get("key")
        and float(e.get("t", 0.0)) > float(fault.get("t", 0.0)))
    if history.variant == DJANGO_VARIANT:
        counts["payments"] = sum(len(row.get("payments", [])) for rows in
                                 history.app_rows.values() for row in rows)
    if history.variant == "enqueue-tx":
        seen = Counter(str(e.get("outcome")).split(":")[0] for e in history.events
                       if e.get("event") == "order")
        counts["orders (committed in the database / rolled back / failed)"] = (
            f"{len(history.orders)} / {seen['rolled_back']} / {seen['failed']}")
        swept = {str(e.get("key")) for e in history.events if e.get("event") == "lease_swept"}
        died = [job_key(str(e.get("job"))) for e in history.events
                if e.get("event") == "fault" and e.get("kind") == "publisher_exit"]
        counts["publishers killed after commit: jobs published by the sweeper / done"] = (
            f"{sum(key in swept for key in died)} / "
            f"{sum(getattr(history.rows.get(key), 'state', None) == 'done' for key in died)} "
            f"of {len(died)}")
        counts["messages purged"] = sum(int(e.get("purged") or 0) for e in history.events
                                        if e.get("event") == "fault_end"
                                        and e.get("kind") == "purge")
    return counts
