"""The app's client for the outside service that receives published reports.

The service is not ours: it has no idempotency contract, so every request it receives is an
effect that happened, and a second request for one report is a duplicate effect.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.request

from .reports import Report, publish_key

__all__ = ["publish"]


def publish(endpoint: str, report: Report, *, timeout: float = 5.0) -> int:
    """POST ``report`` to ``endpoint``; return the HTTP status (errors raise)."""
    body = json.dumps({"key": publish_key(report), "report": report}).encode()
    request = urllib.request.Request(
        endpoint, data=body, method="POST",
        headers={"Content-Type": "application/json",
                 "X-Sender": f"{socket.gethostname()}:{os.getpid()}"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        status: int = response.status
        return status
