"""The chaos harness's ``django-tx`` variant, a short run on PostgreSQL: real workers whose job
bodies write Django models (an order and its payment) and complete their key in one
``self.lease.atomic()`` block, the store ``django://default``, under every fault that
applies. The checker passes: one order (with its one payment) per done key, of the key's
final token, none for a key not done, and every other check at 0.

The run sets Django up in its own processes with the harness's project
(``benchmarks/chaos/djapp``, a schema of the run's own), not this test process's; it is here
because this is the pytest that runs with Django installed. .ci/run runs it on Django 5.2 only
(the latest Django's run leaves it out, ``--ignore``): its models and the
store's statements do not depend on Django's version. Its figures at full size are in
docs/proof.md; its checks on doctored histories in tests/workers/test_chaos_tx.py.
"""

from __future__ import annotations

import os

import pytest

from tests.support.chaos import run_chaos
from tests.support.servers import postgres_reachable, redis_reachable, require

#: A backstop: the harness bounds each phase itself (30–50 s measured on a loaded machine).
RUN_TIMEOUT = 150


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_a_short_django_chaos_run_passes() -> None:
    """80 jobs over 8 s, each fault at least twice: kills, stalls, connection kills, slow
    replies, killed sweeps, exits and stalls after an accepted finish, and exits right after
    the atomic block committed. The run passes every check."""
    require("Redis", *redis_reachable())
    require("PostgreSQL", *postgres_reachable())
    # The environment of this test process's Django project (its settings, databases and
    # queue) is not the run's: the harness's workers and its migrate set their own.
    env = {name: value for name, value in os.environ.items()
           if name != "DJANGO_SETTINGS_MODULE" and not name.startswith("LEASE_TEST_DJANGO")}
    output = run_chaos(["--store", "postgres", "--variant", "django-tx", "--tasks", "80",
                        "--seconds", "8", "--faults", "all", "--settle", "45"],
                       timeout=RUN_TIMEOUT, what="the django-tx run on PostgreSQL", env=env)
    assert "order_payment" in output  # the variant's own check ran
