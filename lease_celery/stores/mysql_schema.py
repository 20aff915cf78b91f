"""The MySQL store's schema: made by the first store to connect, migrated by the first of a
newer lease_celery, checked by every one.

DDL in MySQL commits on its own and cannot be rolled back: a named lock (``GET_LOCK``)
serialises the workers that start at once instead of a transaction, and every step may be run
again (``IF NOT EXISTS``; the triggers dropped and made again). The version is written last,
so a store that died half-way is finished by the next one.
"""

from __future__ import annotations

from typing import Any

from ..errors import StoreError
from .sql_glue import SCHEMA_VERSION, check_schema_version

__all__ = ["MIGRATIONS", "dialect_queries", "make_schema", "stored_schema_version"]

#: Schema version -> the statements (query names) that bring a store at the previous version
#: to it. The MySQL store was born at schema 7 (``sql_glue.SCHEMA_VERSION``): a later version
#: adds its step here, run in order from the version a database has.
MIGRATIONS: dict[int, tuple[str, ...]] = {8: ("migrate_effects_state_index",)}

_CREATE = ("create_leases", "create_fence", "create_history", "create_effects", "create_meta",
           "create_limits", "create_waiters")
_TRIGGERS = ("drop_history_on_claim", "create_history_on_claim", "drop_history_on_transition",
             "create_history_on_transition")


def dialect_queries(queries: dict[str, str], version: str, *, now: str,
                    clock: str) -> dict[str, str]:
    """``queries`` for the server of ``version`` (``SELECT VERSION()``): the clock expression
    and the binary, no-pad collation put in. MariaDB before 10.6 (no SKIP LOCKED) is refused."""
    mariadb = "mariadb" in version.lower()
    if mariadb and _release(version) < (10, 6):
        raise StoreError(f"MariaDB {version} is too old for the lease store: it needs 10.6 or "
                         "later (SKIP LOCKED, sequences)")
    if not mariadb:
        raise StoreError(f"MySQL {version}: this lease_celery runs its MySQL store on MariaDB "
                         "10.6 or later only (the fence is a SEQUENCE, which MySQL lacks)")
    collation = "utf8mb4_nopad_bin"
    return {name: sql.replace("{now}", now).replace("{clock}", clock)
            .replace("{collation}", collation)
            for name, sql in queries.items()}


def _release(version: str) -> tuple[int, ...]:
    numbers = version.split("-", 1)[0].split(".")
    try:
        return tuple(int(n) for n in numbers[:2])
    except ValueError:
        return (0,)


def make_schema(conn: Any, queries: dict[str, str], where: str) -> None:
    """Make, migrate or check the schema on ``conn`` (autocommit), under the named lock."""
    with conn.cursor() as cur:
        cur.execute(queries["lock_schema"])
        if not cur.fetchone()["got"]:
            raise StoreError(f"{where}: another process held the schema lock for 30 s")
        try:
            version = stored_schema_version(cur, queries)
            check_schema_version(version, where)
            if version == SCHEMA_VERSION:
                return  # no DDL: it would wait for running workers' metadata locks
            for name in _CREATE:
                cur.execute(queries[name])
            # A new store's tables are made whole by _CREATE; an older one's take the steps
            # after its version.
            for step in range(SCHEMA_VERSION + 1 if version is None else version + 1,
                              SCHEMA_VERSION + 1):
                for name in MIGRATIONS.get(step, ()):
                    cur.execute(queries[name])
            for name in _TRIGGERS:
                cur.execute(queries[name])
            cur.execute(queries["set_schema_version"], {"version": str(SCHEMA_VERSION)})
        finally:
            cur.execute(queries["unlock_schema"])


def stored_schema_version(cur: Any, queries: dict[str, str]) -> int | None:
    """The schema version recorded in the database (None: no lease tables), read on a cursor
    whose rows are dicts."""
    cur.execute("SELECT COUNT(*) AS n FROM information_schema.tables "
                "WHERE table_schema = DATABASE() AND table_name = 'lease_celery_meta'")
    if not cur.fetchone()["n"]:
        return None
    cur.execute(queries["get_schema_version"])
    row = cur.fetchone()
    return None if row is None else int(row["value"])
