"""Isolated places for one run: a lease store of its own, its broker keys, and their cleanup.

- sqlite: a file in the run's temp directory.
- postgres: a fresh schema ``chaos_<run>`` on postgresql://127.0.0.1:5432/test, dropped after.
- mysql: a fresh database ``chaos_<run>`` on the MariaDB at 127.0.0.1:3306, dropped after.
- redis: keys under ``chaos_<run>:`` in Redis database 14, deleted after; or, for the
  ``store-restart`` fault, database 0 of a redis-server of the run's own
  (:class:`~benchmarks.chaos.storeserver.OwnRedis`), stopped after.

Servers are reached by the workers through a :class:`~benchmarks.chaos.proxy.DelayingProxy`
(so replies can be slowed), and tagged with a name of the run's own (PostgreSQL
``application_name``, Redis ``client_name``, MySQL the run's own database), so a connection
kill hits the lease store's connections of this run and nothing else on the server. The
checker reads the store directly.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import redis

from .proxy import DelayingProxy
from .storeserver import OwnRedis, mysql_admin, restart_mariadb, restart_postgres

__all__ = ["BROKER_DB", "MYSQL_HOST", "MYSQL_PORT", "PG_DSN", "REDIS_HOST", "REDIS_PORT",
           "STORES", "STORE_DB", "StoreSandbox", "delete_keys", "redis_client", "store_sandbox"]

REDIS_HOST = "127.0.0.1"
# LEASE_TEST_REDIS_PORT: the Redis of the broker and event log, as the test suite's.
REDIS_PORT = int(os.environ.get("LEASE_TEST_REDIS_PORT", "6379"))
#: Redis database of the chaos runs' lease stores (keys under a per-run prefix).
STORE_DB = 14
#: Redis database of the chaos runs' broker, result backend and event log (per-run prefix).
BROKER_DB = 15
#: The store's database on a redis-server of the run's own (nothing else lives there).
OWN_STORE_DB = 0
PG_DSN = "postgresql://127.0.0.1:5432/test"
MYSQL_HOST, MYSQL_PORT = "127.0.0.1", 3306
STORES = ("sqlite", "postgres", "redis", "mysql")


@dataclass
class StoreSandbox:
    kind: str
    worker_url: str  # what the workers use
    checker_url: str  # what the harness reads the final state through (no proxy)
    tag: str  # application_name / client_name of the workers' store connections
    proxy: DelayingProxy | None = None
    own_redis: OwnRedis | None = None  # the run's own store server (store-restart on Redis)

    @property
    def restartable(self) -> bool:
        """Whether ``restart_server`` applies: the machine's PostgreSQL or MariaDB, or a Redis
        of the run's own (never the machine's Redis: other test runs live on it)."""
        return self.kind in ("postgres", "mysql") or self.own_redis is not None

    def restart_server(self, down: float) -> float:
        """Restart the store's server (a Redis of our own stays down ``down`` seconds; a
        PostgreSQL restart takes what it takes); return the seconds it did not answer."""
        if self.kind == "postgres":
            return restart_postgres(PG_DSN)
        if self.kind == "mysql":
            return restart_mariadb(MYSQL_HOST, MYSQL_PORT)
        if self.own_redis is not None:
            return self.own_redis.restart(down)
        raise ValueError(f"the {self.kind} store has no server of the run's own to restart")

    def _redis_server(self) -> tuple[redis.Redis, int]:
        """A client of the Redis holding the store, and the store's database number."""
        if self.own_redis is not None:
            return self.own_redis.client(), OWN_STORE_DB
        return redis.Redis(host=REDIS_HOST, port=REDIS_PORT, socket_timeout=5), STORE_DB

    @property
    def has_connections(self) -> bool:
        """Whether connection kills and slow replies apply (not to a SQLite file)."""
        return self.proxy is not None

    def kill_connections(self) -> int:
        """Kill the workers' connections to the store from the server side; return how many."""
        if self.kind == "postgres":
            import psycopg

            with psycopg.connect(PG_DSN, autocommit=True, connect_timeout=5) as conn:
                row = conn.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = 'test' AND pid <> pg_backend_pid() "
                    "AND application_name = %s", (self.tag,)).fetchone()
            return int(row[0]) if row else 0
        if self.kind == "mysql":
            # The run's database is its tag: every connection in it is the run's store's.
            return mysql_admin(MYSQL_HOST, MYSQL_PORT, kill_in=self.tag)
        if self.kind == "redis":
            client, db = self._redis_server()
            killed = 0
            for entry in client.client_list():
                # Only this run's store connections: its name, in the store's database.
                if entry.get("name") == self.tag and str(entry.get("db")) == str(db):
                    with contextlib.suppress(redis.ResponseError):  # it went away meanwhile
                        killed += int(client.client_kill_filter(_id=entry["id"]))
            return killed
        return 0


@contextlib.contextmanager
def store_sandbox(kind: str, run_id: str, folder: Path, *,
                  own_redis: str | None = None) -> Iterator[StoreSandbox]:
    """The run's store; ``own_redis`` (a persistence, ``aof`` or ``none``): a Redis store on a
    redis-server of the run's own, which the ``store-restart`` fault may restart."""
    tag = f"chaos_{run_id}"
    if kind == "sqlite":
        url = f"sqlite:///{folder / 'leases.sqlite3'}"
        yield StoreSandbox(kind, url, url, tag)
        return
    if kind == "postgres":
        host, port = _host_port(PG_DSN, 5432)
        proxy = DelayingProxy(host, port)
        worker_url = (f"postgresql://127.0.0.1:{proxy.port}/test?schema={tag}"
                      f"&application_name={tag}")
        try:
            yield StoreSandbox(kind, worker_url, f"{PG_DSN}?schema={tag}", tag, proxy)
        finally:
            proxy.close()
            _drop_schema(tag)
        return
    if kind == "mysql":
        mysql_admin(MYSQL_HOST, MYSQL_PORT, create=tag)
        proxy = DelayingProxy(MYSQL_HOST, MYSQL_PORT)
        try:
            yield StoreSandbox(kind, f"mysql://root@127.0.0.1:{proxy.port}/{tag}",
                               f"mysql://root@{MYSQL_HOST}:{MYSQL_PORT}/{tag}", tag, proxy)
        finally:
            proxy.close()
            mysql_admin(MYSQL_HOST, MYSQL_PORT, kill_in=tag, drop=tag)
        return
    if kind == "redis" and own_redis is not None:
        server = OwnRedis(folder / "redis", persistence=own_redis)
        server.start()
        try:
            proxy = DelayingProxy("127.0.0.1", server.port)
            prefix = f"{tag}:"
            direct = f"redis://127.0.0.1:{server.port}/{OWN_STORE_DB}?prefix={prefix}"
            worker_url = (f"redis://127.0.0.1:{proxy.port}/{OWN_STORE_DB}?prefix={prefix}"
                          f"&client_name={tag}")
            try:
                yield StoreSandbox(kind, worker_url, direct, tag, proxy, own_redis=server)
            finally:
                proxy.close()
        finally:
            server.close()
        return
    if kind == "redis":
        proxy = DelayingProxy(REDIS_HOST, REDIS_PORT)
        prefix = f"{tag}:"
        worker_url = (f"redis://127.0.0.1:{proxy.port}/{STORE_DB}?prefix={prefix}"
                      f"&client_name={tag}")
        try:
            yield StoreSandbox(kind, worker_url,
                               f"redis://{REDIS_HOST}:{REDIS_PORT}/{STORE_DB}?prefix={prefix}",
                               tag, proxy)
        finally:
            proxy.close()
            delete_keys(STORE_DB, prefix)
        return
    raise ValueError(f"unknown store {kind!r}; one of {', '.join(STORES)}")


def _host_port(url: str, default: int) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or default


def _drop_schema(schema: str) -> None:
    import psycopg

    with psycopg.connect(PG_DSN, autocommit=True, connect_timeout=5) as conn:
        # Connections a killed worker left behind would hold locks on the schema's tables.
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                     "datname = 'test' AND pid <> pg_backend_pid() AND application_name = %s",
                     (schema,))
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def redis_client(db: int) -> redis.Redis:
    return redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=db, socket_timeout=10,
                       socket_connect_timeout=5)


def delete_keys(db: int, prefix: str) -> int:
    """Delete every key of ``db`` that starts with ``prefix`` (the run's own keys only)."""
    client = redis_client(db)
    deleted = 0
    batch: list[bytes] = []
    for key in client.scan_iter(match=f"{_glob_escape(prefix)}*", count=1000):
        batch.append(key)
        if len(batch) >= 500:
            deleted += int(client.delete(*batch))
            batch.clear()
    if batch:
        deleted += int(client.delete(*batch))
    return deleted


def _glob_escape(text: str) -> str:
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)
