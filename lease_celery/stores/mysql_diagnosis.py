"""What the MySQL store says about its server (``MySQLStore.diagnose``, through ``celery
leases doctor``): the settings a lease's promises rest on.

A token must never go back: a claim's commit has to survive a crash of the server
(``innodb_flush_log_at_trx_commit=1``) and, where the binary log feeds replicas that may be
promoted, of the binary log too (``sync_binlog=1``). The store sets its own sessions to READ
COMMITTED and UTC, so the server's defaults there are only reported.
"""

from __future__ import annotations

from typing import Any

from ..models import Finding

__all__ = ["server_findings"]

_VARIABLES = ("version", "innodb_flush_log_at_trx_commit", "sync_binlog", "log_bin",
              "read_only", "transaction_isolation", "tx_isolation", "time_zone",
              "system_time_zone", "binlog_format")


def server_findings(conn: Any) -> list[Finding]:
    """The findings about the server ``conn`` is connected to (read-only queries)."""
    with conn.cursor() as cur:
        cur.execute("SHOW GLOBAL VARIABLES WHERE Variable_name IN ("
                    + ", ".join(["%s"] * len(_VARIABLES)) + ")", _VARIABLES)
        found = {row["Variable_name"]: str(row["Value"]) for row in cur.fetchall()}
        replica = _replica_status(cur)
    return (_durability(found) + _isolation(found) + _time_zone(found)
            + _replication(found, replica))


def _durability(found: dict[str, str]) -> list[Finding]:
    out = []
    flush = found.get("innodb_flush_log_at_trx_commit")
    if flush != "1":
        out.append(Finding(
            "store.mysql_flush_log", "error", "ownership",
            f"innodb_flush_log_at_trx_commit={flush}: a server crash (or, at 2, a power loss) "
            "can lose the last committed claims, and a key's token could be handed out twice. "
            "Set innodb_flush_log_at_trx_commit=1"))
    else:
        out.append(Finding("store.mysql_flush_log", "ok", "ownership",
                           "innodb_flush_log_at_trx_commit=1: every commit is on disk"))
    if found.get("log_bin", "OFF").upper() in ("ON", "1") and found.get("sync_binlog") != "1":
        out.append(Finding(
            "store.mysql_sync_binlog", "warning", "ownership",
            f"sync_binlog={found.get('sync_binlog')} with the binary log on: after a crash the "
            "binary log may lack commits InnoDB kept, and a replica promoted from it would hand "
            "out tokens again. Set sync_binlog=1"))
    return out


def _isolation(found: dict[str, str]) -> list[Finding]:
    level = found.get("transaction_isolation") or found.get("tx_isolation") or "?"
    return [Finding(
        "store.mysql_isolation", "ok", "ownership",
        f"the server's default isolation is {level}; the store's own sessions run READ "
        "COMMITTED (no gap locks), and fenced() blocks too")]


def _time_zone(found: dict[str, str]) -> list[Finding]:
    zone = found.get("time_zone", "?")
    shown = f"{zone} ({found['system_time_zone']})" if zone == "SYSTEM" else zone
    return [Finding(
        "store.mysql_time_zone", "ok", "ownership",
        f"the server's time zone is {shown}; the store reads the clock as UTC epoch seconds on "
        "sessions set to +00:00, so the zone (and its daylight saving changes) does not move "
        "a deadline")]


def _replication(found: dict[str, str], replica: dict[str, Any] | None) -> list[Finding]:
    if replica is not None:
        source = replica.get("Master_Host") or replica.get("Source_Host") or "?"
        return [Finding(
            "store.mysql_replica", "error", "ownership",
            f"this server replicates from {source}: a replica's rows lag its source, and "
            "leases written here are not the source's. Point the lease store at the primary")]
    if found.get("read_only", "OFF").upper() in ("ON", "1"):
        return [Finding("store.mysql_read_only", "error", "ownership",
                        "the server is read_only: every claim would be refused")]
    return []


def _replica_status(cur: Any) -> dict[str, Any] | None:
    """This server's replication from a source, if it has one and the user may see it."""
    for statement in ("SHOW REPLICA STATUS", "SHOW SLAVE STATUS"):
        try:
            cur.execute(statement)
        except Exception:
            continue
        row: dict[str, Any] | None = cur.fetchone()
        return row
    return None
