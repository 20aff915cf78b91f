"""The lease admin in a real browser (headless chromium through chromedriver), served by
the project's own ``manage.py runserver``: sign in, list the leases, filter them, release a
running lease with the action and its form, and find the release in the key's history.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from lease_celery.stores.registry import shared_store
from tests.support.browser import headless_chromium, wait_until_replaced
from tests.support.workers import REPO

ALIAS = "pg"
PASSWORD = "operator-password-7c1e"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def site(django_project: dict[str, str], tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[str]:
    """``runserver`` of the test project, the admin on the store of django://pg."""
    port = free_port()
    log = tmp_path_factory.mktemp("runserver") / "runserver.log"
    env = {**os.environ, **django_project, "LEASE_TEST_STORE": f"django://{ALIAS}",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with log.open("w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "django", "runserver", f"127.0.0.1:{port}", "--noreload",
             "--insecure"], env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/admin/login/", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"runserver did not start:\n{log.read_text()}"
                                         ) from None
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with headless_chromium() as driver:
        yield driver


def test_an_operator_signs_in_filters_releases_and_reads_the_history(
        site: str, browser: Any) -> None:
    from django.contrib.auth.models import User
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    name = f"operator{uuid.uuid4().hex[:6]}"
    User.objects.create_superuser(name, password=PASSWORD)
    store = shared_store(f"django://{ALIAS}")
    prefix = f"browser{uuid.uuid4().hex[:6]}:"
    held = prefix + "stuck"
    assert store.claim(held, owner="hung-worker:1", ttl=600) is not None
    done = store.claim(prefix + "done", owner="w:2", ttl=600)
    assert done is not None and store.finish(done, {"ok": 1})

    browser.get(f"{site}/admin/login/?next=/admin/lease_celery/lease/")
    browser.find_element(By.NAME, "username").send_keys(name)
    password = browser.find_element(By.NAME, "password")
    password.send_keys(PASSWORD)
    password.submit()
    browser.find_element(By.ID, "changelist")  # signed in, on the leases' list

    browser.get(f"{site}/admin/lease_celery/lease/?q={prefix}")
    rows = browser.find_element(By.ID, "result_list").text
    assert held in rows and prefix + "done" in rows

    # The state filter, as the operator clicks it in the sidebar.
    link = browser.find_element(By.CSS_SELECTOR,
                                "#changelist-filter a[href*='state__exact=running']")
    link.click()
    wait_until_replaced(link)
    rows = browser.find_element(By.ID, "result_list").text
    assert held in rows and prefix + "done" not in rows

    # Release: tick the row, pick the action, Go, give a reason, confirm.
    box = browser.find_element(By.CSS_SELECTOR, f"input.action-select[value='{held}']")
    box.click()
    Select(browser.find_element(By.NAME, "action")).select_by_value("release")
    go = browser.find_element(By.CSS_SELECTOR, "button[name='index']")
    go.click()
    wait_until_replaced(go)
    browser.find_element(By.NAME, "reason").send_keys("worker hung on the card processor")
    submit = browser.find_element(By.ID, "lease-action-submit")
    submit.click()
    wait_until_replaced(submit)
    said = browser.find_element(By.CLASS_NAME, "messagelist").text.lower()
    assert f"{held}: released" in said
    record = store.get(held)
    assert record is not None and record.state.value == "ready"

    # The key's history, from its row's link.
    browser.get(f"{site}/admin/lease_celery/lease/?q={prefix}")
    history = browser.find_element(
        By.XPATH, f"//tr[.//a[text()='{held}']]//a[text()='history']")
    history.click()
    wait_until_replaced(history)
    text = browser.find_element(By.ID, "result_list").text
    assert "operator:release" in text
    assert f"{name} via the Django admin: worker hung on the card processor" in text
