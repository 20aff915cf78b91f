"""A moto SQS server on a loopback port, for the tests and the chaos harness.

``LEASE_TEST_SQS_PORT`` names one already running (``.ci/run`` starts one); otherwise the
first caller in a process starts ``moto_server`` on a free port, and stops it when the process
exits. kombu's SQS transport reaches it over plain HTTP (``is_secure=False``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["REGION", "SQS_HOST", "broker_url", "sqs_client", "sqs_port", "transport_options"]

SQS_HOST = "127.0.0.1"
#: The region kombu names in its requests (moto keeps queues per region).
REGION = "us-east-1"

_started: subprocess.Popen[bytes] | None = None
_own_port: int | None = None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((SQS_HOST, 0))
        return int(sock.getsockname()[1])


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{SQS_HOST}:{port}/?Action=ListQueues",
                                    timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def _moto_server() -> str | None:
    found = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
    return found if Path(found).exists() else None


def sqs_port() -> tuple[int | None, str]:
    """The port of a moto SQS server that answers (started here if none was given), or None
    and why not."""
    global _started, _own_port
    given = os.environ.get("LEASE_TEST_SQS_PORT")
    if given:
        port = int(given)
        return (port, "") if _answers(port) else (None, f"no SQS server on port {port}")
    if _own_port is not None:
        return _own_port, ""
    program = _moto_server()
    if program is None:
        return None, "moto_server is not installed (pip install -e . --group test)"
    port = _free_port()
    _started = subprocess.Popen([program, "-H", SQS_HOST, "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    atexit.register(_stop)
    deadline = time.monotonic() + 30
    while not _answers(port):
        if time.monotonic() > deadline or _started.poll() is not None:
            return None, f"moto_server did not answer on port {port}"
        time.sleep(0.1)
    _own_port = port
    return port, ""


def _stop() -> None:
    if _started is not None and _started.poll() is None:
        _started.terminate()
        _started.wait(10)


def broker_url(port: int) -> str:
    """kombu's SQS URL of the server: the credentials are moto's to ignore."""
    return f"sqs://lease:tests@{SQS_HOST}:{port}"


def transport_options(visibility_timeout: float) -> dict[str, Any]:
    """Plain HTTP, moto's region, a long poll of 1 s (moto answers it as soon as a message
    arrives), and 0.1 s between polls."""
    return {"region": REGION, "is_secure": False, "visibility_timeout": visibility_timeout,
            "polling_interval": 0.1, "wait_time_seconds": 1}


def sqs_client(port: int) -> Any:
    """A boto3 SQS client of the server (queue counts, cleanup)."""
    import boto3

    return boto3.client("sqs", region_name=REGION, endpoint_url=f"http://{SQS_HOST}:{port}",
                        aws_access_key_id="lease", aws_secret_access_key="tests")
