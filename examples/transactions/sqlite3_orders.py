"""Exactly-once database effects on SQLite with the ``sqlite3`` module.

The lease store and the app's tables share one SQLite file. Run::

    python -m examples.transactions.sqlite3_orders [PATH]
"""

from __future__ import annotations

import sqlite3
import sys
import tempfile
from pathlib import Path
from typing import Any

import lease_celery
from examples.transactions.shop import Rollback, make_app, tell, worker
from lease_celery import LeasedTask

PATH = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()) / "shop.sqlite3"
app = make_app("sqlite3_orders", f"sqlite:///{PATH}")


def connect() -> sqlite3.Connection:
    conn = sqlite3.connect(PATH, timeout=30)
    conn.execute("CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, amount INTEGER)")
    conn.execute("CREATE TABLE IF NOT EXISTS payments (order_id INTEGER, token INTEGER)")
    conn.commit()
    return conn


@app.task(base=LeasedTask, bind=True, lease_key="pay:{order_id}")
def pay(self: LeasedTask, order_id: int) -> dict[str, Any]:
    conn = connect()
    try:
        with self.lease.transaction(conn) as tx:  # the payment and the finish: one commit
            conn.execute("INSERT INTO payments VALUES (?, ?)", (order_id, self.lease.token))
            return tx.complete({"order": order_id, "token": self.lease.token})
    finally:
        conn.close()


def place_order(order_id: int, amount: int, cancel: bool) -> Any:
    conn = connect()
    try:
        with lease_celery.transaction(conn):  # commits, then publishes what it enqueued
            conn.execute("INSERT INTO orders VALUES (?, ?)", (order_id, amount))
            result = pay.apply_async((order_id,), lease_transaction=conn)
            if cancel:
                raise Rollback()
        return result
    finally:
        conn.close()


def paid() -> list[tuple[int, int]]:
    conn = connect()
    try:
        return conn.execute("SELECT o.id, COUNT(p.order_id) FROM orders o LEFT JOIN payments p"
                            " ON p.order_id = o.id GROUP BY o.id ORDER BY o.id").fetchall()
    finally:
        conn.close()


def main() -> list[tuple[int, int]]:
    connect().close()
    with worker(app):
        return tell(place_order, pay, paid)


if __name__ == "__main__":
    main()
