"""A RabbitMQ vhost of a test's own: created with ``rabbitmqctl``, deleted afterwards.

Runs that share the server then never see each other's queues, exchanges or reply queues.
Without ``rabbitmqctl`` on this machine (a remote server) the default vhost ``/`` is used and
the tests keep apart by their queue names, which are unique per test.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from tests.support.servers import RABBITMQ_USER, rabbitmq_reachable, rabbitmq_url, require

#: Bound on one ``rabbitmqctl`` call (each starts an Erlang VM: about 1 s here).
CTL_TIMEOUT = 30.0


def _ctl(*args: str) -> None:
    ctl = shutil.which("rabbitmqctl")
    assert ctl is not None
    done = subprocess.run([ctl, "-q", *args], capture_output=True, text=True,
                          timeout=CTL_TIMEOUT, check=False)
    if done.returncode != 0:
        raise AssertionError(f"rabbitmqctl {' '.join(args)} failed ({done.returncode}):\n"
                             f"{done.stdout}{done.stderr}")


@contextmanager
def private_vhost(prefix: str = "lease_test") -> Iterator[str]:
    """Yield the broker URL of a fresh vhost (``<prefix>_<hex>``), deleted on the way out.

    RabbitMQ unreachable: the test fails under CI=true and is skipped elsewhere.
    """
    reachable, detail = rabbitmq_reachable()
    require("RabbitMQ", reachable, detail)
    if shutil.which("rabbitmqctl") is None:
        yield rabbitmq_url("/")
        return
    vhost = f"{prefix}_{uuid.uuid4().hex[:12]}"
    _ctl("add_vhost", vhost)
    try:
        _ctl("set_permissions", "-p", vhost, RABBITMQ_USER, ".*", ".*", ".*")
        yield rabbitmq_url(vhost)
    finally:
        _ctl("delete_vhost", vhost)
