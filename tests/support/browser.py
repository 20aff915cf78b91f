"""Waiting for a browser navigation to finish, for the selenium tests.

Selenium's ``staleness_of`` treats only ``StaleElementReferenceException`` as "the old page is
gone". While Chrome swaps documents, chromedriver can instead answer a probe of the old node
with a generic ``WebDriverException`` ("unhandled inspector error: Node with given id does not
belong to the document"): the node is half gone. CI once failed on exactly that answer, so the
wait here counts it as "not yet" and probes again, which then reports the node stale.
"""

from __future__ import annotations

from typing import Any

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
