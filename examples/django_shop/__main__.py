"""``python -m examples.django_shop``: a Django shop whose orders are paid by a leased task.

Sets the project up on SQLite (migrations, an admin user), starts two real ``celery worker``
processes on kombu's filesystem broker, and plays a story: orders enqueued in the
transactions that create them (``delay_on_commit``, the row is the outbox), one delivered
twice, one whose worker is SIGKILLed while paying, one whose worker stalls (SIGSTOP) past its
lease and wakes up to find its payment refused. Each order ends paid exactly once; the key's
history says how. Then it serves the admin (``--no-admin``: it does not).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TTL = 2.0


def say(text: str) -> None:
    print(text, flush=True)


class Workers:
    """``celery worker`` processes of the shop, each in a process group of its own."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.running: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str) -> None:
        log = self.data / f"worker-{name}.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO), os.environ.get("PYTHONPATH", "")])}
        with log.open("wb") as out:
            self.running[name] = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "examples.django_shop.shop_site",
                 "worker", "-P", "prefork", "-c", "2", "-n", f"{name}@%h", "-O", "fair",
                 "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info"],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        wait_for(lambda: "ready." in log.read_text(errors="replace"), 60,
                 f"worker {name} to start (see {log})")

    def owner_of(self, pid: int) -> str:
        """The worker whose pool process ``pid`` is."""
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        return next(name for name, p in self.running.items() if p.pid in (pid, parent))

    def kill(self, name: str) -> None:
        process = self.running.pop(name)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)

    def stop(self) -> None:
        for process in self.running.values():
            os.killpg(process.pid, signal.SIGTERM)
        for process in self.running.values():
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        self.running.clear()


def wait_for(done: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


def setup(data: Path) -> None:
    for folder in ("broker", "broker-control", "results"):
        (data / folder).mkdir(parents=True, exist_ok=True)
    os.environ["SHOP_DATA_DIR"] = str(data)
    os.environ["DJANGO_SETTINGS_MODULE"] = "examples.django_shop.shop_site.settings"
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0, interactive=False)
    from django.contrib.auth.models import User

    if not User.objects.filter(username="admin").exists():
        User.objects.create_superuser("admin", password="admin")  # an example's, not yours


def story(workers: Workers) -> bool:
    from django.db import transaction

    from examples.django_shop.shop.models import Attempt, Order
    from examples.django_shop.shop.tasks import pay_order
    from examples.django_shop.shop_site.celery import app  # noqa: F401  (binds the task)

    def order(number: str, work: float) -> Order:
        # The order and its task's row in one transaction: published once it commits.
        with transaction.atomic():
            created = Order.objects.create(number=number, amount=100)
            pay_order.delay_on_commit(created.pk, work=work)
        return created

    def paid(found: Order) -> bool:
        found.refresh_from_db()
        return found.paid_token is not None

    def started(found: Order) -> int:
        wait_for(lambda: Attempt.objects.filter(order=found, outcome="started").exists(), 30,
                 f"order {found.number} to start")
        return int(Attempt.objects.filter(order=found, outcome="started").first().pid)

    say("1. Order A is paid; order B's task is delivered twice (two messages, one key).")
    plain, twice = order("A", 0.2), order("B", 1.0)
    pay_order.delay(twice.pk, work=1.0)  # the duplicate: another task id, the same key
    wait_for(lambda: paid(plain) and paid(twice), 60, "orders A and B")

    say("2. Order C: its worker is SIGKILLed while paying. The lease expires, and the other "
        "worker's sweeper publishes the order again from its row.")
    killed = order("C", 30.0)
    victim = workers.owner_of(started(killed))
    workers.kill(victim)
    say(f"   worker {victim} killed")
    wait_for(lambda: paid(killed), 60, "order C, taken over")
    workers.start("three")

    say("3. Order D: its worker stalls (SIGSTOP) past its lease, is taken over, and wakes up "
        "to write its payment: the lease's transaction refuses it and rolls back.")
    stalled = order("D", 3.0)
    pid = started(stalled)
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: paid(stalled), 60, "order D, taken over")
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: Attempt.objects.filter(order=stalled, outcome__startswith="refused")
             .exists(), 30, "the stalled worker's payment to be refused")
    return report([plain, twice, killed, stalled])


def report(orders: list[Any]) -> bool:
    from examples.django_shop.shop.models import Attempt
    from lease_celery.stores.registry import shared_store

    store = shared_store("django://default")
    say("\norder  payments  paid by token  attempts (token: outcome)")
    once = True
    for found in orders:
        found.refresh_from_db()
        tokens = list(found.payments.values_list("token", flat=True))
        once = once and len(tokens) == 1
        tried = ", ".join(f"{a.token}: {a.outcome}" for a in Attempt.objects.filter(
            order=found).exclude(outcome="started").order_by("id"))
        say(f"{found.number:<6} {len(tokens):<9} {found.paid_token!s:<14} {tried}")
    say("\nThe history of order D's key (the store writes it; the admin shows it too):")
    for entry in store.history(f"pay:{orders[-1].pk}"):
        say(f"  token {entry.token}  {entry.event:<16} {entry.detail or ''}")
    say("\nEvery order was paid exactly once." if once else "\nAN ORDER WAS PAID TWICE.")
    return once


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.django_shop", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, help="where the database, the broker's "
                        "folders and the logs go (default: a new temporary directory)")
    parser.add_argument("--no-admin", action="store_true",
                        help="exit after the story instead of serving the admin")
    parser.add_argument("--port", type=int, default=8000, help="the admin's port (8000)")
    args = parser.parse_args(argv)
    data = (args.data_dir or Path(tempfile.mkdtemp(prefix="django-shop-"))).resolve()
    say(f"Setting the shop up in {data} (SQLite: the app's tables and the lease store's).")
    setup(data)
    workers = Workers(data)
    try:
        workers.start("one")
        workers.start("two")
        ok = story(workers)
    finally:
        workers.stop()
    if args.no_admin:
        return 0 if ok else 1
    from django.core.management import call_command

    say(f"\nThe admin: http://127.0.0.1:{args.port}/admin/ (user admin, password admin): "
        "Leases, Effect receipts, History, Key-group limits, Orders. Ctrl-C stops it.")
    call_command("runserver", f"127.0.0.1:{args.port}", use_reloader=False)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
