"""The ``django-tx`` variant's database, on the harness's side: the run's schema migrated by
the Django project (:mod:`.djapp`) before any worker starts, and the models read back as the
app rows the transactional checks judge (``txchecks.py``).

``migrate`` runs in a process of its own (``python -m django migrate``), so the harness never
imports Django; the read is plain SQL on the tables the migrations made.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from .appdb import AppDatabase
from .workers import REPO

__all__ = ["DjangoDatabase"]

#: Seconds ``migrate`` may take (a loaded 2-core machine; it takes about 2 s).
MIGRATE_TIMEOUT = 120


@dataclass(frozen=True)
class DjangoDatabase:
    """The run's Django database: ``url`` is the ``postgresql://...?schema=`` the harness
    reaches it by (directly, not through the proxy)."""

    url: str

    def migrate(self) -> None:
        """Make the schema and run every migration (the lease store's tables, the shop's)."""
        from .djangotx import SETTINGS

        db = AppDatabase.of(self.url)
        conn = db.connect()
        try:  # the search_path of Django's connections names it: it must exist first
            conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{db.schema}"')
            conn.commit()
        finally:
            conn.close()
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": SETTINGS, "CHAOS_DATABASE_URL": self.url,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                           os.environ.get("PYTHONPATH")]))}
        done = subprocess.run([sys.executable, "-m", "django", "migrate", "--no-input", "-v", "0"],
                              cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=MIGRATE_TIMEOUT, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"migrate for the django-tx run failed:\n{done.stdout}"
                               f"{done.stderr}")

    def read(self) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str]]:
        """Every committed order as an app row (job -> rows, each with its payments' tokens),
        and no orders of ``enqueue-tx``'s kind: ``AppDatabase.read``'s shape."""
        db = AppDatabase.of(self.url)
        conn = db.connect()
        try:
            found = conn.execute(
                f"SELECT o.job, o.token, o.pid, o.task_id, "
                f"COALESCE(array_agg(p.token ORDER BY p.id) FILTER (WHERE p.id IS NOT NULL), "
                f"'{{}}') FROM {db.table('chaos_shop_order')} o "
                f"LEFT JOIN {db.table('chaos_shop_payment')} p ON p.order_id = o.id "
                "GROUP BY o.id ORDER BY o.job, o.token, o.id").fetchall()
        finally:
            conn.close()
        rows: dict[str, list[dict[str, Any]]] = {}
        for job, token, pid, task_id, payments in found:
            rows.setdefault(job, []).append({"token": token, "pid": pid, "task_id": task_id,
                                             "payments": list(payments)})
        return rows, {}
