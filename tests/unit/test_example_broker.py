"""The demo's broker (example_project/broker.py): kombu's filesystem transport, except that a
message is never visible to a consumer before it is written whole.

A consumer reads at the worst instant: after the producer opened the message file, before it
wrote a byte (the hook runs where both ``_put`` encode the payload). kombu's own channel hands
that consumer an empty file, which it cannot decode (a demo worker died of it in CI); the
demo's channel shows it nothing until the message is complete.
"""

from __future__ import annotations

from pathlib import Path
from queue import Empty
from typing import Any

import pytest
from kombu import Connection
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes

from example_project import broker

TRANSPORTS = [pytest.param(None, id="kombu"),
              pytest.param("example_project.broker:Transport", id="demo")]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_consumer_never_reads_a_message_before_it_is_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, transport: str | None) -> None:
    options = {"data_folder_in": str(tmp_path), "data_folder_out": str(tmp_path)}
    with Connection("filesystem://", transport=transport, transport_options=options) as writer, \
            Connection("filesystem://", transport=transport,
                       transport_options=options) as reader:
        seen: list[Any] = []

        def read_mid_write(text: str) -> bytes:
            try:
                seen.append(reader.default_channel._get("q"))
            except Empty:
                seen.append("empty")
            except ValueError as exc:  # JSONDecodeError: the empty file
                seen.append(exc)
            return str_to_bytes(text)

        monkeypatch.setattr(filesystem, "str_to_bytes", read_mid_write)
        monkeypatch.setattr(broker, "str_to_bytes", read_mid_write)
        writer.default_channel._put("q", {"body": "whole"})
        if transport is None:
            assert isinstance(seen[0], ValueError), seen  # the race, in kombu's own
            return
        assert seen == ["empty"]
        assert reader.default_channel._get("q") == {"body": "whole"}
