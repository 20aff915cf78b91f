"""Exactly-once database effects through SQLAlchemy: a ``Session`` in the publisher, a
``Connection`` in the task.

The lease store lives in the app's database (PostgreSQL here; a SQLite file works the same
way). A Session publishes what it enqueued as it commits, by itself. Run::

    python -m examples.transactions.sqlalchemy_orders [POSTGRES_URL] [SCHEMA]

(default ``postgresql://127.0.0.1:5432/test`` and ``shop_sqlalchemy``; the schema is made anew).
"""

from __future__ import annotations

import sys
from typing import Any

import sqlalchemy
from sqlalchemy import Column, ForeignKey, Integer, MetaData, Table, func, insert, select
from sqlalchemy.orm import Session

from examples.transactions.shop import Rollback, make_app, tell, worker
from lease_celery import LeasedTask

DSN = sys.argv[1] if len(sys.argv) > 1 else "postgresql://127.0.0.1:5432/test"
SCHEMA = sys.argv[2] if len(sys.argv) > 2 else "shop_sqlalchemy"
app = make_app("sqlalchemy_orders", f"{DSN}?schema={SCHEMA}")
engine = sqlalchemy.create_engine(DSN.replace("postgresql://", "postgresql+psycopg://"))

metadata = MetaData(schema=SCHEMA)
orders = Table("orders", metadata, Column("id", Integer, primary_key=True),
               Column("amount", Integer))
payments = Table("payments", metadata, Column("order_id", ForeignKey(orders.c.id)),
                 Column("token", Integer))


@app.task(base=LeasedTask, bind=True, lease_key="pay:{order_id}")
def pay(self: LeasedTask, order_id: int) -> dict[str, Any]:
    with engine.connect() as conn, self.lease.transaction(conn) as tx:  # one commit
        conn.execute(insert(payments).values(order_id=order_id, token=self.lease.token))
        return tx.complete({"order": order_id, "token": self.lease.token})


def place_order(order_id: int, amount: int, cancel: bool) -> Any:
    with Session(engine) as session, session.begin():  # published as it commits
        session.execute(insert(orders).values(id=order_id, amount=amount))
        result = pay.apply_async((order_id,), lease_transaction=session)
        if cancel:
            raise Rollback()
        return result


def paid() -> list[tuple[int, int]]:
    with engine.connect() as conn:
        query = (select(orders.c.id, func.count(payments.c.order_id))
                 .outerjoin(payments).group_by(orders.c.id).order_by(orders.c.id))
        return [(order_id, count) for order_id, count in conn.execute(query)]


def main() -> list[tuple[int, int]]:
    with engine.begin() as conn:
        conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')
        conn.exec_driver_sql(f'CREATE SCHEMA "{SCHEMA}"')
        metadata.create_all(conn)
    with worker(app):
        return tell(place_order, pay, paid)


if __name__ == "__main__":
    main()
