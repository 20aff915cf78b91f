"""The ``enqueue-tx`` variant's publishers: processes that enqueue ``chaos.job`` inside their
own transactions, and roll back about half of them.

Each order is one transaction on the app's connection to the store's database: an order row
(``chaos_orders``) and ``apply_async(..., lease_transaction=conn)`` (the key's row, the message
held). Then, as the plan says, one of three ways (``Order.how``):

- ``transaction``: ``lease_celery.transaction(conn)`` commits, then publishes; an exception
  inside it rolls back;
- ``by_hand``: ``conn.commit()`` then ``lease_celery.publish_committed(conn)``, and the
  ``publisher`` fault's ticket makes the process exit between the two (the sweeper must
  publish from the row); or ``conn.rollback()`` then ``publish_committed(conn)``, which must
  drop what the rollback took with it;
- ``session``: a SQLAlchemy ``Session`` (``with session.begin():``), which publishes on its
  own commit; ``session.rollback()`` inside the block rolls back.

A process killed by its ticket is started again with the orders it had not begun
(:class:`TxPublishers`, in the harness). What committed is read from the database at the end
(the orders table is the truth); every ``order`` event names the outcome the publisher saw.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from .appdb import AppDatabase
from .config import ChaosConfig
from .events import EventLog
from .flags import Flags
from .workers import REPO

__all__ = ["Order", "TxPublishers", "main", "plan_orders"]

#: The exit status of a publisher that took a ``publisher_exit`` ticket (restarted).
EXIT_FAULT = 3
#: The ways an order's transaction ends (see the module's docstring).
HOW = ("transaction", "by_hand", "session")


@dataclass(frozen=True)
class Order:
    at: float  # seconds after the start of publishing
    job: str
    task_id: str
    sleep_ms: int
    commit: bool
    how: str  # "transaction" | "by_hand" | "session"


def plan_orders(tasks: int, seconds: float, rng: random.Random, *,
                rollback: float = 0.5) -> list[Order]:
    return [Order(at=seconds * n / max(tasks, 1), job=f"j{n:05d}",
                  task_id=str(uuid.UUID(int=rng.getrandbits(128), version=4)),
                  sleep_ms=rng.randint(0, 300), commit=rng.random() >= rollback,
                  how=rng.choice(HOW))
            for n in range(tasks)]


class _Rollback(Exception):
    """Raised inside ``lease_celery.transaction`` to roll an order back."""


# -- the publisher process ---------------------------------------------------------------------


def main() -> int:
    """``python -m benchmarks.chaos.txpublish`` (started by :class:`TxPublishers`)."""
    import lease_celery

    from .publish import recording_task
    from .run import client_app

    config = ChaosConfig.from_env(os.environ)
    slot, start = int(os.environ["CHAOS_PUBLISHER"]), float(os.environ["CHAOS_START"])
    orders = [Order(**o) for o in json.loads(Path(os.environ["CHAOS_ORDERS"]).read_text())]
    store_url = os.environ["CHAOS_DIRECT_STORE_URL"]
    events, flags = EventLog(config.backend_url, config.events_key), Flags(Path(config.flags_dir))
    db = AppDatabase.of(store_url)
    client = client_app(config)
    client.conf.lease_store_url = store_url
    task = recording_task(client)
    conn = session = None
    for order in orders:
        time.sleep(max(0.0, start + order.at - time.time()))
        try:
            os.kill(config.harness_pid, 0)
        except ProcessLookupError:
            return 1  # the harness is gone: no orphans
        if conn is None:
            conn = db.connect()
        if session is None:
            from sqlalchemy.orm import Session

            session = Session(db.engine())
        outcome = "committed" if order.commit else "rolled_back"
        args = (order.job, order.sleep_ms)
        try:
            if order.how == "session":
                with session.begin():
                    db.insert_order(session, order.job, order.task_id)
                    task.apply_async(args, task_id=order.task_id, lease_transaction=session)
                    if not order.commit:
                        session.rollback()
            elif order.how == "transaction":
                try:
                    with lease_celery.transaction(conn):
                        db.insert_order(conn, order.job, order.task_id)
                        task.apply_async(args, task_id=order.task_id, lease_transaction=conn)
                        if not order.commit:
                            raise _Rollback()
                except _Rollback:
                    pass
            else:
                db.insert_order(conn, order.job, order.task_id)
                task.apply_async(args, task_id=order.task_id, lease_transaction=conn)
                (conn.commit if order.commit else conn.rollback)()
                if order.commit and flags.take("publisher_exit"):
                    events.record("order", slot=slot, job=order.job, task_id=order.task_id,
                                  outcome=outcome)
                    events.record("fault", kind="publisher_exit", job=order.job,
                                  task_id=order.task_id)
                    os._exit(EXIT_FAULT)  # committed, never published: the row is the outbox
                lease_celery.publish_committed(conn)
        except Exception as exc:  # a broken connection: the database says what committed
            outcome = f"failed: {exc!r}"[:300]
            conn.close()
            session.close()
            conn = session = None
        events.record("order", slot=slot, job=order.job, task_id=order.task_id,
                      outcome=outcome)
    return 0


# -- the harness's side ------------------------------------------------------------------------


class TxPublishers:
    """``slots`` publisher processes, each with its share of the orders; one that exits by
    its fault ticket is started again with the orders it had not begun."""

    def __init__(self, config: ChaosConfig, orders: list[Order], *, slots: int, folder: Path,
                 events: EventLog, direct_store_url: str) -> None:
        self.config, self.orders, self.slots = config, orders, slots
        self.folder, self.events, self.direct_store_url = folder, events, direct_store_url
        self.errors: list[str] = []
        self.restarts = 0
        self._halt = threading.Event()
        self._processes: dict[int, subprocess.Popen[bytes]] = {}
        self._threads = [threading.Thread(target=self._serve, args=(slot,), daemon=True,
                                          name=f"chaos-txpublisher-{slot}")
                         for slot in range(slots)]
        self._start = 0.0

    def start(self) -> None:
        self._start = time.time()
        for thread in self._threads:
            thread.start()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        self._halt.set()
        for process in list(self._processes.values()):
            if process.poll() is None:
                process.kill()
                process.wait(10)

    def _serve(self, slot: int) -> None:
        mine = self.orders[slot::self.slots]
        run = 0
        while mine and not self._halt.is_set():
            run += 1
            status = self._publish(slot, run, mine)
            begun = {e["job"] for e in self.events.read()
                     if e.get("event") == "order" and e.get("slot") == slot}
            mine = [o for o in mine if o.job not in begun]
            if status == EXIT_FAULT:
                self.restarts += 1
                continue
            if status != 0 and not self._halt.is_set():
                self.errors.append(f"publisher {slot} exited with {status} (see "
                                   f"publisher-{slot}-{run}.log)")
            return

    def _publish(self, slot: int, run: int, orders: list[Order]) -> int:
        path = self.folder / f"orders-{slot}-{run}.json"
        path.write_text(json.dumps([dataclasses.asdict(o) for o in orders]))
        env = {**os.environ, **self.config.to_env(), "CHAOS_PUBLISHER": str(slot),
               "CHAOS_START": repr(self._start), "CHAOS_ORDERS": str(path),
               "CHAOS_DIRECT_STORE_URL": self.direct_store_url,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                           os.environ.get("PYTHONPATH")]))}
        with open(self.folder / f"publisher-{slot}-{run}.log", "wb") as log:
            process = subprocess.Popen([sys.executable, "-m", "benchmarks.chaos.txpublish"],
                                       cwd=self.folder, env=env, stdout=log,
                                       stderr=subprocess.STDOUT)
        self._processes[slot] = process
        while process.poll() is None:
            if self._halt.wait(0.2):
                process.kill()
        return int(process.wait())


if __name__ == "__main__":
    sys.exit(main())
