"""The MySQL store's key-group limits: a limited claim and the hand-on of freed slots, each
in the caller's transaction, on the instant ``at`` it read once.

The group's row is locked first (``SELECT ... FOR UPDATE``): the claims of one group are
serialised, no others, and the running count read after the lock sees every claim of the
group committed before (READ COMMITTED: each statement reads the latest committed rows). The
verdict is ``stores.base.group_verdict``, the rule the SQLite store applies too.
"""

from __future__ import annotations

from typing import Any

from .base import Row, effective_interval, effective_limit, group_verdict

__all__ = ["claim_limited", "hand_on"]


def _one(conn: Any, query: str, params: dict[str, Any]) -> Row | None:
    with conn.cursor() as cur:
        cur.execute(query, params)
        row: Row | None = cur.fetchone()
        return row


def _count(conn: Any, query: str, params: dict[str, Any]) -> int:
    row = _one(conn, query, params)
    return 0 if row is None else int(row["n"])


def _execute(conn: Any, query: str, params: dict[str, Any]) -> int:
    with conn.cursor() as cur:
        return int(cur.execute(query, params))


def claim_limited(conn: Any, q: dict[str, str], params: dict[str, Any],
                  at: float) -> Row | None:
    """The limited claim of ``params['key']`` in group ``params['grp']``: the claim's row
    with ``verdict`` granted, a refusal row (``limit``, ``rate``), or None (the key refuses)."""
    bound = {**params, "at": at, "now": at}
    _execute(conn, q["limit_upsert"], bound)
    group = _one(conn, q["limit_lock"], bound)
    assert group is not None  # written just above, in this transaction
    lim = effective_limit(group["task_limit"], group["set_limit"])
    interval = effective_interval(group["task_interval"], group["set_interval"])
    if _one(conn, q["key_held"], bound) is not None:
        _execute(conn, q["waiter_drop"], bound)
        return None
    running = _count(conn, q["group_running"], bound)
    ahead = _count(conn, q["waiters_ahead"], bound)
    verdict = group_verdict(limit=lim, interval=interval, running=running, ahead=ahead,
                            tat=group["tat"], now=at)
    if verdict == "limit":
        task = bound["task"]
        if task is not None and _execute(conn, q["waiter_park"], {
                **bound, "seq": int(group["seq"]) + 1}):
            _execute(conn, q["group_seq_bump"], bound)
        return {"verdict": verdict, "running": running, "lim": lim,
                "waiting": _count(conn, q["waiter_count"], bound)}
    if verdict == "rate":
        return {"verdict": verdict, "running": running, "lim": lim, "retry_at": group["tat"]}
    _execute(conn, q["claim"], {**bound, "slot": int(group["slots"]) + 1})
    row = _one(conn, q["claimed_by"], bound)
    if row is None:  # the key refused after all (a claim of it crossed ours)
        return None
    _execute(conn, q["group_granted"], {**bound, "interval": interval})
    _execute(conn, q["waiter_drop"], bound)
    return {**row, "verdict": verdict}


def hand_on(conn: Any, q: dict[str, str], group: str | None, grace: float, limit: int,
            at: float) -> list[Row]:
    """The first waiters of each group (or of ``group``) for which a slot is free, but those
    handed on less than ``grace`` ago: marked handed and returned."""
    with conn.cursor() as cur:
        if group is None:
            cur.execute(q["groups_waiting"], {"limit": limit})
            groups = [row["grp"] for row in cur.fetchall()]
        else:
            groups = [group]
    handed: list[Row] = []
    for grp in groups:
        found = _one(conn, q["group_limit"], {"grp": grp})
        lim = None if found is None else effective_limit(found["task_limit"],
                                                         found["set_limit"])
        free = limit - len(handed)
        if lim is not None:
            free = min(free, lim - _count(conn, q["group_running"],
                                          {"grp": grp, "at": at, "key": ""}))
        if free <= 0:
            continue
        with conn.cursor() as cur:
            cur.execute(q["waiters_first"], {"grp": grp, "limit": free})
            waiters = list(cur.fetchall())
        for row in waiters:
            if row["handed_at"] is None or row["handed_at"] <= at - grace:
                _execute(conn, q["waiter_handed"], {"grp": grp, "key": row["key"], "at": at})
                handed.append(row)
    return handed
