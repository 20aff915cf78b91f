"""Waiting for a browser navigation to finish, for the selenium tests.

Selenium's ``staleness_of`` treats only ``StaleElementReferenceException`` as "the old page is
gone". While Chrome swaps documents, chromedriver can instead answer a probe of the old node
with a generic ``WebDriverException`` ("unhandled inspector error: Node with given id does not
belong to the document"): the node is half gone. CI once failed on exactly that answer, so the
wait here counts it as "not yet" and probes again, which then reports the node stale.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.support.servers import missing

# chromedriver's words for a node caught between two documents.
_IN_TRANSITION = "does not belong to the document"


def is_replaced(element: Any) -> bool:
    """True once ``element``'s document has been replaced; False while it is still shown or
    while the browser is between the two documents."""
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException

    try:
        element.is_enabled()
    except StaleElementReferenceException:
        return True
    except WebDriverException as exc:
        if _IN_TRANSITION in str(exc):
            return False
        raise
    return False


def wait_until_replaced(element: Any, timeout: float = 10.0, poll: float = 0.05) -> None:
    """Wait until the page holding ``element`` has been replaced by the next one (selenium's
    own wait, polling :func:`is_replaced`)."""
    from selenium.webdriver.support.wait import WebDriverWait

    WebDriverWait(element, timeout, poll_frequency=poll).until(
        lambda _: is_replaced(element), f"the page was not replaced within {timeout} s")


@contextmanager
def headless_chromium() -> Iterator[Any]:
    """Headless Debian chromium driven by Debian's chromedriver through selenium; missing
    parts fail the run under CI=true and skip the test elsewhere."""
    chromium = shutil.which("chromium")
    driver_path = shutil.which("chromedriver")
    if not (chromium and driver_path):
        missing("chromium and chromedriver not installed: apt-get install -y chromium "
                "chromium-driver (.ci/run does)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as exc:
        missing(f"selenium not installed: pip install -e . --group test ({exc})")
    options = webdriver.ChromeOptions()
    options.binary_location = str(chromium)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--window-size=1280,1000"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(str(driver_path)), options=options)
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()
