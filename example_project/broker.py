"""kombu's filesystem transport, with each message written whole before it can be read.

kombu's ``Channel._put`` creates the message file in the folder consumers read and then
writes it: a worker polling at that instant moves the empty file away and dies on the JSON
it cannot decode (CI saw a demo worker exit on it). Here the message is written under a name
no consumer picks up (not ``*.<queue>.msg``) and renamed into place, which POSIX makes atomic.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

__all__ = ["Transport"]


class Channel(filesystem.Channel):  # type: ignore[misc]
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        staging = os.path.join(self.data_folder_out, f".{uuid.uuid4().hex}.staging")
        try:
            with open(staging, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))
            os.replace(staging, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):  # type: ignore[misc]
    Channel = Channel
