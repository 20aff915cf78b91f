"""The admin pages of the lease store, through Django's test client, on SQLite,
PostgreSQL and MariaDB: the lists, their filters and search, and the operator actions (each one of
lease_celery.ops, so the key's history records it as the CLI's would), behind permissions.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from lease_celery.errors import EffectOutcomeUnknown
from lease_celery.stores.base import Store
from lease_celery.stores.registry import shared_store

pytestmark = pytest.mark.usefixtures("django_project")


@pytest.fixture(params=["default", "pg", "my"])
def alias(request: pytest.FixtureRequest) -> Iterator[str]:
    """The admin on the store of this database alias (SQLite, PostgreSQL, MariaDB)."""
    from django.test import override_settings

    with override_settings(LEASE_CELERY_STORE_URL=f"django://{request.param}"):
        yield request.param


@pytest.fixture
def store(alias: str) -> Store:
    return shared_store(f"django://{alias}")


@pytest.fixture
def prefix() -> str:
    import uuid

    return f"adm{uuid.uuid4().hex[:6]}:"


def user(name: str, *perms: str, superuser: bool = False) -> Any:
    from django.contrib.auth.models import Permission, User

    found = User.objects.filter(username=name).first()
    if found is None:
        found = (User.objects.create_superuser(name, password="pw") if superuser else
                 User.objects.create_user(name, password="pw", is_staff=True))
    for perm in perms:
        found.user_permissions.add(Permission.objects.get(codename=perm))
    return found


def client_for(account: Any) -> Any:
    from django.test import Client

    client = Client()
    client.force_login(account)
    return client


def act(client: Any, url: str, action: str, keys: list[str], **form: str) -> Any:
    """An admin action as the browser runs it: the form first, then the form posted back."""
    first = client.post(url, {"action": action, "_selected_action": keys})
    assert first.status_code == 200, first.content[:500]
    assert b"lease-action-form" in first.content
    return client.post(url, {"action": action, "_selected_action": keys, "apply": "yes",
                             "select_across": "0", **form}, follow=True)


def test_the_lease_list_filters_and_searches(store: Store, prefix: str) -> None:
    running = store.claim(prefix + "running", owner="w1", ttl=60)
    done = store.claim(prefix + "done", owner="w1", ttl=60)
    assert running is not None and done is not None
    store.finish(done, {"ok": True})
    client = client_for(user("root", superuser=True))
    url = "/admin/lease_celery/lease/"
    page = client.get(url, {"q": prefix}).content.decode()
    assert prefix + "running" in page and prefix + "done" in page
    page = client.get(url, {"q": prefix, "state__exact": "running"}).content.decode()
    assert prefix + "running" in page and prefix + "done" not in page
    assert "more than" not in page  # a short list: its count is exact
    detail = client.get(f"{url}{prefix}done/change/").content.decode()
    assert "finished" in detail  # the key's history on its page


def test_release_is_an_operator_action_recorded_in_the_keys_history(store: Store,
                                                                     prefix: str) -> None:
    key = prefix + "held"
    lease = store.claim(key, owner="stuck-worker", ttl=60)
    assert lease is not None
    client = client_for(user("root", superuser=True))
    done = act(client, "/admin/lease_celery/lease/", "release", [key], reason="worker hung")
    # (The admin capitalises a message's first letter.)
    assert f"{key}: released" in done.content.decode().lower()
    record = store.get(key)
    assert record is not None and record.state.value == "ready"
    assert not store.finish(lease, "late")  # the old holder's result is refused
    [entry] = [e for e in store.history(key) if e.event == "operator:release"]
    assert entry.detail == "root via the Django admin: worker hung"
    history = client.get("/admin/lease_celery/historyentry/", {"key": key}).content.decode()
    assert "operator:release" in history


def test_cancel_and_requeue(store: Store, prefix: str) -> None:
    key = prefix + "job"
    store.record_published(key, task={"name": "t", "id": "i", "args": [], "kwargs": {}})
    client = client_for(user("root", superuser=True))
    act(client, "/admin/lease_celery/lease/", "cancel", [key])
    record = store.get(key)
    assert record is not None and record.state.value == "dead"
    page = act(client, "/admin/lease_celery/lease/", "requeue", [key]).content.decode().lower()
    assert f"{key}: requeued" in page
    record = store.get(key)
    assert record is not None and record.state.value == "ready"
    events = [e.event for e in store.history(key)]
    assert "operator:cancel" in events and "operator:requeue" in events


def test_a_receipt_in_the_reconcile_queue_is_resolved_or_discarded(store: Store,
                                                                    prefix: str) -> None:
    def lost(key: str) -> None:
        raise EffectOutcomeUnknown("the payment provider timed out")

    for name in ("resolve", "discard"):
        with pytest.raises(EffectOutcomeUnknown):
            store.effects.once(prefix + name, {"amount": 5}, lost)
    client = client_for(user("root", superuser=True))
    url = "/admin/lease_celery/receipt/"
    queue = client.get(url, {"state__exact": "needs_reconciliation", "q": prefix})
    page = queue.content.decode()
    # Filtered by state, the newest first (a range of the receipts' state index).
    assert page.index(prefix + "discard") < page.index(prefix + "resolve")
    act(client, url, "resolve", [prefix + "resolve"], result='{"charge": "ch_1"}')
    receipt = store.effects.get(prefix + "resolve")
    assert receipt is not None and receipt.result == {"charge": "ch_1"}
    act(client, url, "discard", [prefix + "discard"])
    assert store.effects.get(prefix + "discard") is None


def test_a_limit_is_changed_from_the_admin(store: Store, prefix: str) -> None:
    group = prefix + "api"
    store.set_limit(group, concurrency=2)
    client = client_for(user("root", superuser=True))
    page = act(client, "/admin/lease_celery/limitgroup/", "change_limit", [group],
               concurrency="5", rate="").content.decode().lower()
    assert f"{group}: " in page
    [found] = [g for g in store.limits() if g.group == group]
    assert found.limit == 5
    assert any(e.event == "operator:limit" for e in store.history("lease_celery:limit:" + group))


def test_actions_need_their_permission(store: Store, prefix: str) -> None:
    key = prefix + "guarded"
    assert store.claim(key, owner="w", ttl=60) is not None
    viewer = client_for(user("viewer", "view_lease"))
    page = viewer.get("/admin/lease_celery/lease/", {"q": prefix})
    assert page.status_code == 200 and key in page.content.decode()
    assert not re.search(r'<option value="release"', page.content.decode())
    viewer.post("/admin/lease_celery/lease/", {"action": "release", "_selected_action": [key],
                                               "apply": "yes", "select_across": "0"})
    record = store.get(key)
    assert record is not None and record.state.value == "running"
    releaser = client_for(user("releaser", "view_lease", "release_lease"))
    act(releaser, "/admin/lease_celery/lease/", "release", [key])
    record = store.get(key)
    assert record is not None and record.state.value == "ready"
    anonymous = client_for(user("nobody"))  # staff, no permission at all
    assert anonymous.get("/admin/lease_celery/lease/").status_code == 403
