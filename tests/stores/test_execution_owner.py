"""Each execution gets an owner of its own (``<process owner>/<n>``), and listing by a
process's owner finds all of its executions, on every store."""

from __future__ import annotations

import threading
import time

import pytest

from lease_celery.identity import execution_owner, owned_by, process_owner
from lease_celery.stores.base import Store


@pytest.fixture
def store(stores: list[Store]) -> Store:
    return stores[0]


def test_executions_of_one_process_are_told_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight threads of a fresh process (a -P threads worker starting eight tasks at once)
    each get an execution of one process owner. The first calls used to race: each thread
    that found no owner yet made one (CI: the test ran first in its pytest process)."""
    from lease_celery import identity

    hostname = identity.socket.gethostname

    def slow_hostname() -> str:
        time.sleep(0.01)  # widens the window between "no owner yet" and "owner made"
        return hostname()

    monkeypatch.setattr(identity, "_owner", None)
    monkeypatch.setattr(identity.socket, "gethostname", slow_hostname)
    seen: list[str] = []
    threads = [threading.Thread(target=lambda: seen.append(execution_owner()))
               for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(seen)) == 8
    assert all(owned_by(owner, process_owner()) for owner in seen)
    assert not owned_by(process_owner() + "0/1", process_owner())  # a prefix is not a match
    assert not owned_by(None, process_owner())


def test_listing_by_a_process_owner_finds_its_executions(store: Store) -> None:
    process = "host:1:abc"
    for n, owner in enumerate([f"{process}/1", f"{process}/2", "host:1:abcd/1",
                               "other:2:def/1"]):
        assert store.claim(f"k{n}", owner=owner, ttl=30) is not None
    assert {r.key for r in store.find(owner=process)} == {"k0", "k1"}
    assert [r.key for r in store.find(owner=f"{process}/2")] == ["k1"]
