"""Exactly-once database effects on PostgreSQL with psycopg 3.

The lease store lives in the app's database, in the schema that holds the app's tables. Run::

    python -m examples.transactions.psycopg_orders [POSTGRES_URL] [SCHEMA]

(default ``postgresql://127.0.0.1:5432/test`` and ``shop_psycopg``; the schema is made anew).
"""

from __future__ import annotations

import sys
from typing import Any

import psycopg

import lease_celery
from examples.transactions.shop import Rollback, make_app, tell, worker
from lease_celery import LeasedTask

DSN = sys.argv[1] if len(sys.argv) > 1 else "postgresql://127.0.0.1:5432/test"
SCHEMA = sys.argv[2] if len(sys.argv) > 2 else "shop_psycopg"
app = make_app("psycopg_orders", f"{DSN}?schema={SCHEMA}")


def connect() -> psycopg.Connection[Any]:
    """A connection whose search path is the shop's schema (the store names its own)."""
    return psycopg.connect(DSN, options=f"-c search_path={SCHEMA}")


@app.task(base=LeasedTask, bind=True, lease_key="pay:{order_id}")
def pay(self: LeasedTask, order_id: int) -> dict[str, Any]:
    with connect() as conn, self.lease.transaction(conn) as tx:  # one commit for both
        conn.execute("INSERT INTO payments VALUES (%s, %s)", (order_id, self.lease.token))
        return tx.complete({"order": order_id, "token": self.lease.token})


def place_order(order_id: int, amount: int, cancel: bool) -> Any:
    with connect() as conn, lease_celery.transaction(conn):  # commit, then publish
        conn.execute("INSERT INTO orders VALUES (%s, %s)", (order_id, amount))
        result = pay.apply_async((order_id,), lease_transaction=conn)
        if cancel:
            raise Rollback()
        return result


def paid() -> list[tuple[int, int]]:
    with connect() as conn:
        return conn.execute("SELECT o.id, COUNT(p.order_id)::int FROM orders o LEFT JOIN "
                            "payments p ON p.order_id = o.id GROUP BY o.id ORDER BY o.id"
                            ).fetchall()


def main() -> list[tuple[int, int]]:
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')
        conn.execute(f'CREATE SCHEMA "{SCHEMA}"')
    with connect() as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, amount int)")
        conn.execute("CREATE TABLE payments (order_id int, token bigint)")
    with worker(app):
        return tell(place_order, pay, paid)


if __name__ == "__main__":
    main()
