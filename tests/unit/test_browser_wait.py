"""The browser tests' navigation wait survives chromedriver's half-gone node answer.

CI failed once in test_web_browser: selenium's ``staleness_of`` let chromedriver's
"Node with given id does not belong to the document" escape as a WebDriverException while the
next page was loading. These fakes replay that sequence of answers without a browser.
"""

from __future__ import annotations

import pytest

pytest.importorskip("selenium")

from selenium.common.exceptions import (
    StaleElementReferenceException,
    TimeoutException,
    WebDriverException,
)

from tests.support.browser import wait_until_replaced

IN_TRANSITION = ('unknown error: unhandled inspector error: {"code":-32000,"message":'
                 '"Node with given id does not belong to the document"}')


class ScriptedElement:
    """An element whose ``is_enabled`` answers from a script: True, or an exception."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.probes = 0

    def is_enabled(self) -> bool:
        self.probes += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return bool(answer)


def test_a_node_between_documents_counts_as_not_yet_replaced() -> None:
    element = ScriptedElement(True, WebDriverException(IN_TRANSITION),
                              StaleElementReferenceException("stale"))
    wait_until_replaced(element, timeout=5, poll=0.001)
    assert element.probes == 3


def test_any_other_driver_error_still_fails_the_wait() -> None:
    element = ScriptedElement(WebDriverException("chrome not reachable"))
    with pytest.raises(WebDriverException, match="chrome not reachable"):
        wait_until_replaced(element, timeout=5, poll=0.001)


def test_a_page_that_never_changes_times_out() -> None:
    element = ScriptedElement(*([True] * 1000))
    with pytest.raises(TimeoutException, match="not replaced"):
        wait_until_replaced(element, timeout=0.05, poll=0.001)
