"""The plain task's result table: each report as the app last wrote it.

The plain task writes blindly (last writer wins), which is what an unfenced result write does.
Every write is also logged with when the build that produced it *started*, so the demo can
show the stale ones: a write whose build started before the build it overwrote.
"""

from __future__ import annotations

import json
import sqlite3
import time
from contextlib import closing
from typing import Any

from .reports import Report

__all__ = ["ReportWrite", "save_report", "writes"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS reports (
    edition TEXT NOT NULL, report_id INTEGER NOT NULL, body TEXT NOT NULL,
    built_by TEXT NOT NULL, started_at REAL NOT NULL, written_at REAL NOT NULL,
    PRIMARY KEY (edition, report_id));
CREATE TABLE IF NOT EXISTS report_writes (
    edition TEXT NOT NULL, report_id INTEGER NOT NULL, built_by TEXT NOT NULL,
    started_at REAL NOT NULL, written_at REAL NOT NULL, overwrote_newer INTEGER NOT NULL);
"""

ReportWrite = dict[str, Any]


def _connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=30, isolation_level=None)
    conn.executescript(_SCHEMA)
    return conn


def save_report(path: str, report: Report, *, built_by: str, started_at: float) -> bool:
    """Write ``report`` over whatever is there; return True if that was a newer build's."""
    with closing(_connect(path)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        row = conn.execute("SELECT started_at FROM reports WHERE edition = ? AND report_id = ?",
                           (report["edition"], report["report_id"])).fetchone()
        overwrote_newer = row is not None and row[0] > started_at
        now = time.time()
        conn.execute(
            "INSERT INTO reports VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (edition, report_id) "
            "DO UPDATE SET body = excluded.body, built_by = excluded.built_by, "
            "started_at = excluded.started_at, written_at = excluded.written_at",
            (report["edition"], report["report_id"], json.dumps(report), built_by,
             started_at, now))
        conn.execute("INSERT INTO report_writes VALUES (?, ?, ?, ?, ?, ?)",
                     (report["edition"], report["report_id"], built_by, started_at, now,
                      int(overwrote_newer)))
        conn.execute("COMMIT")
        return overwrote_newer


def writes(path: str, edition: str) -> list[ReportWrite]:
    """Every write of ``edition``'s reports, oldest first."""
    with closing(_connect(path)) as conn:
        rows = conn.execute(
            "SELECT report_id, built_by, started_at, written_at, overwrote_newer "
            "FROM report_writes WHERE edition = ? ORDER BY written_at", (edition,)).fetchall()
    return [{"report_id": r[0], "built_by": r[1], "started_at": r[2], "written_at": r[3],
             "overwrote_newer": bool(r[4])} for r in rows]
