"""The dashboard in a real headless browser (Debian's ``chromium`` through ``chromedriver``),
served by the real CLI (``python -m lease_celery -A tests.support.worker_app --store URL web
--port 0 --token T``).

It lists a dead key whose key and reason hold ``<script>``: shown as text, never run; a
receipt awaiting reconciliation is resolved from its page by typing the token and a result;
an action without the token (or with a wrong one) is refused and changes nothing. Without
chromium, chromedriver or selenium these tests fail under CI=true and skip elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lease_celery import EffectState, Store, open_store
from lease_celery.errors import EffectOutcomeUnknown
from tests.support.browser import headless_chromium, wait_until_replaced
from tests.support.policy_helpers import REPO

TOKEN = "browser-test-token-4f9a"
DEAD_KEY = "nightly:<script>window.pwned = 1; alert('key')</script>"
DEAD_REASON = "gave up: <script>window.pwned = 2; alert('reason')</script>"
EFFECT = "charge:<script>window.pwned = 3</script>:v1"
OTHER_EFFECT = "refund:42:v1"


def _unknown(key: str) -> None:
    raise EffectOutcomeUnknown("the card processor timed out after the request went out")


def _receipt(store: Store, lease_key: str, effect_key: str) -> None:
    """Leave ``effect_key`` needs_reconciliation under a lease of ``lease_key``, then kill it."""
    lease = store.claim(lease_key, owner="host:1:run/1", ttl=600)
    assert lease is not None
    with pytest.raises(EffectOutcomeUnknown):
        store.effects.once(effect_key, {"amount": 42}, _unknown, lease=lease)
    reason = DEAD_REASON if lease_key == DEAD_KEY else "outcome unknown"
    assert store.kill(lease, reason=reason)


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = f"sqlite:///{tmp_path_factory.mktemp('web')}/leases.sqlite3"
    with open_store(url) as store:
        _receipt(store, DEAD_KEY, EFFECT)
        _receipt(store, "refund:42", OTHER_EFFECT)
    yield url


@contextlib.contextmanager
def _serve(store_url: str, folder: Path, *options: str) -> Iterator[str]:
    """The real CLI server on a free loopback port; its URL is read from its first line."""
    log = folder / "server.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with log.open("w") as stderr:
        server = subprocess.Popen(
            [sys.executable, "-m", "lease_celery", "-A", "tests.support.worker_app",
             "--store", store_url,
             "web", "--port", "0",
             "--token", TOKEN, *options], stdout=subprocess.PIPE, stderr=stderr, text=True,
            env=env, cwd=log.parent)
    try:
        assert server.stdout is not None
        ready, _, _ = select.select([server.stdout], [], [], 20)
        line = server.stdout.readline() if ready else ""
        assert "dashboard on http://127.0.0.1:" in line, (line, log.read_text())
        yield line.split(" on ", 1)[1].split()[0].rstrip("/")
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture(scope="module")
def base_url(store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with _serve(store_url, tmp_path_factory.mktemp("web-log")) as served:
        yield served


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Debian chromium driven by Debian's chromedriver through selenium."""
    with headless_chromium() as driver:
        yield driver


def _click_and_load(browser: Any, element: Any) -> None:
    """Click a link or button and wait until the next page has replaced this one."""
    from selenium.webdriver.common.by import By

    page = browser.find_element(By.TAG_NAME, "html")
    element.click()
    wait_until_replaced(page, timeout=10)


def _no_script_ran(browser: Any) -> None:
    """No alert is open, no injected script set its marker, and the page has no script."""
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By

    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text  # noqa: B018 (the property read is the probe)
    assert browser.execute_script("return window.pwned === undefined") is True
    assert browser.find_elements(By.TAG_NAME, "script") == []


def test_dashboard_lists_a_dead_key_with_its_script_as_text(browser: Any,
                                                             base_url: str) -> None:
    """The dead-keys page and the overview list the dead key; its ``<script>`` key and
    reason are visible text and nothing ran."""
    from selenium.webdriver.common.by import By

    for path in ("/dead", "/"):
        browser.get(base_url + path)
        text = browser.find_element(By.TAG_NAME, "main").text
        assert DEAD_KEY in text and DEAD_REASON in text, text
        _no_script_ran(browser)
    _click_and_load(browser, browser.find_element(By.LINK_TEXT, DEAD_KEY))
    assert browser.find_element(By.TAG_NAME, "h1").text == f"Key {DEAD_KEY}"
    assert browser.find_element(By.CSS_SELECTOR, "svg.timeline").is_displayed()
    _no_script_ran(browser)


def test_resolve_a_receipt_from_its_page(browser: Any, base_url: str, store_url: str) -> None:
    """From the reconciliation queue to the receipt's page; typing the token and a result
    and submitting resolves it: the store's receipt is done with that result, and the lease
    key's history records the action."""
    from selenium.webdriver.common.by import By

    browser.get(base_url + "/reconcile")
    _no_script_ran(browser)
    _click_and_load(browser, browser.find_element(By.LINK_TEXT, EFFECT))
    form = browser.find_element(By.ID, "resolve")
    form.find_element(By.NAME, "result").send_keys('{"charge_id": "ch_<1>"}')
    form.find_element(By.NAME, "token").send_keys(TOKEN)
    _click_and_load(browser, form.find_element(By.TAG_NAME, "button"))
    assert browser.find_element(By.TAG_NAME, "h1").text == "Resolved"
    assert "ch_<1>" in browser.find_element(By.CLASS_NAME, "ok").text
    _no_script_ran(browser)
    with open_store(store_url) as store:
        receipt = store.effects.get(EFFECT)
        assert receipt is not None and receipt.state is EffectState.DONE
        assert receipt.result == {"charge_id": "ch_<1>"}
        events = [e for e in store.history(DEAD_KEY) if e.event == "operator:resolve"]
        assert len(events) == 1 and (events[0].detail or "").startswith("web 127.0.0.1: ")


def test_an_action_without_the_token_is_refused(browser: Any, base_url: str,
                                                store_url: str) -> None:
    """Submitting the resolve form with no token, then with a wrong one, shows a refusal and
    leaves the receipt awaiting reconciliation."""
    from selenium.webdriver.common.by import By

    for token in ("", TOKEN[:-1]):
        browser.get(base_url + "/receipt?key=refund%3A42%3Av1")
        form = browser.find_element(By.ID, "resolve")
        form.find_element(By.NAME, "result").send_keys("refunded")
        if token:
            form.find_element(By.NAME, "token").send_keys(token)
        _click_and_load(browser, form.find_element(By.TAG_NAME, "button"))
        assert browser.find_element(By.TAG_NAME, "h1").text == "Wrong operator token"
        assert "nothing was changed" in browser.find_element(By.TAG_NAME, "main").text
    with open_store(store_url) as store:
        receipt = store.effects.get(OTHER_EFFECT)
        assert receipt is not None and receipt.state is EffectState.NEEDS_RECONCILIATION
        assert [e for e in store.history("refund:42") if e.event.startswith("operator:")] == []



def test_protected_reads_sign_in_then_show_the_page(browser: Any, store_url: str,
                                                    tmp_path: Path) -> None:
    """``web --protect-reads``: the dead-keys page is a sign-in form without the key on it;
    a wrong token is refused; the right one signs this browser in, and the link back shows
    the dead key (as text: nothing ran)."""
    from selenium.webdriver.common.by import By

    with _serve(store_url, tmp_path, "--protect-reads") as base:
        browser.delete_all_cookies()
        browser.get(base + "/dead")
        assert browser.find_element(By.TAG_NAME, "h1").text == "Sign in"
        assert "nightly:" not in browser.page_source
        for token, title in ((TOKEN[:-1], "Wrong operator token"), (TOKEN, "Signed in")):
            browser.get(base + "/dead")
            form = browser.find_element(By.ID, "sign-in")
            form.find_element(By.NAME, "token").send_keys(token)
            _click_and_load(browser, form.find_element(By.TAG_NAME, "button"))
            assert browser.find_element(By.TAG_NAME, "h1").text == title
        _click_and_load(browser, browser.find_element(By.LINK_TEXT, "/dead"))
        text = browser.find_element(By.TAG_NAME, "main").text
        assert DEAD_KEY in text and DEAD_REASON in text, text
        _no_script_ran(browser)
