"""The store's own server, restarted under load: what the ``store-restart`` fault restarts.

- PostgreSQL: the machine's cluster, the one the run's schema lives on, restarted with
  ``pg_ctlcluster --skip-systemctl-redirect <version> main restart -m fast``. A fast restart
  ends every session on the server, other users' included (another test run on the machine
  fails), which is why the fault is opt-in and never part of ``--faults all``.
- Redis: a ``redis-server`` of the run's own, on a free port in 16400-16499 and a directory in
  the run folder, never the machine's (its other databases belong to other test runs). With
  ``appendonly yes`` / ``appendfsync always`` (persistence ``aof``) a restart keeps every write
  the server acknowledged; with persistence ``none`` a restart loses every key, which is what
  the Redis store's epoch exists to catch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

__all__ = ["PERSISTENCE", "PORTS", "OwnRedis", "mysql_admin", "restart_mariadb",
           "restart_postgres"]

#: Ports the run's own redis-server may take (the first free one).
PORTS = range(16400, 16500)
#: ``aof``: appendonly yes, appendfsync always; ``none``: nothing on disk.
PERSISTENCE = ("aof", "none")
#: Seconds a server may take to answer after a start, and to exit after a stop.
START_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class OwnRedis:
    """A redis-server of one run: ``start`` (the first picks the port), ``stop``, ``close``."""

    def __init__(self, folder: Path, *, persistence: str = "aof") -> None:
        if persistence not in PERSISTENCE:
            raise ValueError(f"redis persistence {persistence!r}; one of {', '.join(PERSISTENCE)}")
        self.folder, self.persistence = folder, persistence
        folder.mkdir(parents=True, exist_ok=True)
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, db=db, socket_timeout=5,
                           socket_connect_timeout=5)

    def _command(self, port: int) -> list[str]:
        persist = (["--appendonly", "yes", "--appendfsync", "always"]
                   if self.persistence == "aof" else ["--appendonly", "no"])
        return ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                "--dir", str(self.folder), "--save", "", *persist, "--daemonize", "no",
                "--logfile", str(self.folder / "redis.log")]

    def start(self) -> None:
        """Start the server (on the port it had before, if it had one) and wait for PING."""
        ports = [self.port] if self.port else [p for p in PORTS if _free(p)]
        for port in ports:
            # Same process group as the harness: a Ctrl-C in the terminal ends it too.
            process = subprocess.Popen(self._command(port), stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
            if self._answers(process, port):
                self.port, self.process = port, process
                return
            process.kill()
            process.wait(10)
        raise RuntimeError(f"no redis-server of the run's own would start on {ports[:3]}…; "
                           f"see {self.folder / 'redis.log'}")

    def _answers(self, process: subprocess.Popen[bytes], port: int) -> bool:
        deadline = time.monotonic() + START_TIMEOUT
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2,
                             socket_connect_timeout=2)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                return False  # another process took the port between our probe and its bind
            with contextlib.suppress(redis.RedisError):
                if client.ping():
                    client.close()
                    return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        """SIGTERM (Redis then shuts down as on SHUTDOWN: with ``aof`` it fsyncs the log) and
        wait for the exit; SIGKILL if that takes longer than ``STOP_TIMEOUT``."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)

    def restart(self, down: float) -> float:
        """Stop, stay down ``down`` seconds, start again on the same port and directory;
        return how long the server did not answer (stop to first PING)."""
        started = time.monotonic()
        try:
            self.stop()
            time.sleep(down)
        finally:
            self.start()  # in every case: a run never ends with its store down
        return time.monotonic() - started

    def close(self) -> None:
        self.stop()


def postgres_version() -> str:
    """The machine's one PostgreSQL version (the directory in /etc/postgresql)."""
    versions = sorted(os.listdir("/etc/postgresql"))
    if len(versions) != 1:
        raise RuntimeError(f"expected one PostgreSQL version in /etc/postgresql, found "
                           f"{versions}: which cluster holds the store is not clear")
    return versions[0]


def restart_postgres(dsn: str, *, cluster: str = "main") -> float:
    """Restart the machine's cluster (fast: sessions are ended, no checkpoint wait), wait
    until ``dsn`` takes a connection again; return the seconds it did not."""
    import psycopg

    started = time.monotonic()
    command = ["pg_ctlcluster", "--skip-systemctl-redirect", postgres_version(), cluster,
               "restart", "-m", "fast"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: "
                           f"{(done.stderr or done.stdout).strip()[:500]}")
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            psycopg.connect(dsn, connect_timeout=2).close()
            break
        except psycopg.Error:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    return time.monotonic() - started


def mysql_admin(host: str, port: int, *, create: str | None = None, kill_in: str | None = None,
                drop: str | None = None) -> int:
    """On the MariaDB at ``host:port``: create a database, kill every connection in one (all
    but this one; how many), drop one."""
    import pymysql

    conn = pymysql.connect(host=host, port=port, user="root", autocommit=True,
                           connect_timeout=5)
    killed = 0
    try:
        with conn.cursor() as cur:
            if create is not None:
                cur.execute(f"CREATE DATABASE IF NOT EXISTS `{create}`")
            if kill_in is not None:
                cur.execute("SELECT id FROM information_schema.processlist "
                            "WHERE db = %s AND id <> CONNECTION_ID()", (kill_in,))
                for (found,) in cur.fetchall():
                    try:
                        cur.execute(f"KILL CONNECTION {int(found)}")
                        killed += 1
                    except pymysql.Error:
                        pass  # it ended meanwhile
            if drop is not None:
                cur.execute(f"DROP DATABASE IF EXISTS `{drop}`")
    finally:
        conn.close()
    return killed


#: How the machine's MariaDB is started (as .ci/run starts it).
MARIADB_START = ["start-stop-daemon", "--start", "--oknodo", "--background", "--exec",
                 "/usr/sbin/mariadbd"]


def restart_mariadb(host: str, port: int) -> float:
    """Restart the machine's MariaDB (a clean shutdown: InnoDB flushes, every session ends),
    start it as ``.ci/run`` does, wait until it takes a connection again; return the seconds
    it did not. Never leaves it down: a start that fails is tried again until the deadline."""
    import pymysql

    started = time.monotonic()
    stop = subprocess.run(["mariadb-admin", "-h", host, "-P", str(port), "-uroot", "shutdown"],
                          capture_output=True, text=True, timeout=120, check=False)
    if stop.returncode != 0:
        raise RuntimeError(f"mariadb-admin shutdown exited {stop.returncode}: "
                           f"{(stop.stderr or stop.stdout).strip()[:500]}")
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        subprocess.run(MARIADB_START, capture_output=True, timeout=30, check=False)
        try:
            pymysql.connect(host=host, port=port, user="root", connect_timeout=2).close()
            break
        except pymysql.Error:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    return time.monotonic() - started
