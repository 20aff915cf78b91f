"""The contract between the harness and its worker processes: one environment, read in one place.

The harness builds a :class:`ChaosConfig`, passes it to each ``celery worker`` as environment
variables (``to_env``), and the chaos app reads it back (``from_env``). Broker and result
backend options come from :meth:`ChaosConfig.celery_conf`, shared by the workers' app and the
harness's publishing client, so both sides agree on key prefix, queue and serializers.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["APP_DB_VARIANTS", "CALLBACK_TASK", "DJANGO_VARIANT", "JOB_TASK",
           "PLAIN_CALLBACK_TASK", "TX_VARIANTS", "VARIANTS", "ChaosConfig", "effect_key",
           "job_key"]

#: The LeasedTask under test: sleeps, sends one effect, returns its token.
JOB_TASK = "chaos.job"
#: Its ``link`` callback, itself a LeasedTask keyed by its own task id (the default key).
CALLBACK_TASK = "chaos.on_done"
#: Its second ``link`` callback, a plain Celery task (at-least-once, no lease).
PLAIN_CALLBACK_TASK = "chaos.on_done_plain"

#: What a run's jobs do. ``plain``: one outside effect, the finish after the body.
#: ``app-tx``: the effect, then an app row and the finish in one transaction of the app's
#: connection (``self.lease.transaction``). ``enqueue-tx``: the app-tx body, published by
#: processes that enqueue inside their own transactions (``lease_transaction=conn``).
#: ``django-tx``: the effect, then Django models (an order and its payment) and the finish in
#: one ``self.lease.atomic()`` block, the store ``django://default`` (PostgreSQL).
VARIANTS = ("plain", "app-tx", "enqueue-tx", "django-tx")
DJANGO_VARIANT = "django-tx"
#: The variants whose bodies complete in the app's transaction (an app row per done key).
TX_VARIANTS = ("app-tx", "enqueue-tx", DJANGO_VARIANT)
#: The variants whose app tables are ``appdb.py``'s, written on the app's own connections
#: (the Django variant's are its models, written through the ORM).
APP_DB_VARIANTS = ("app-tx", "enqueue-tx")

_PREFIX = "CHAOS_"


def job_key(job: str) -> str:
    """The lease key of job ``job`` (the task's ``lease_key="job:{job}"``)."""
    return f"job:{job}"


def effect_key(job: str) -> str:
    """The business key of the one outside action job ``job`` performs."""
    return f"send:{job}"


@dataclass(frozen=True)
class ChaosConfig:
    """Everything a worker of one chaos run needs to know."""

    broker_url: str  # Redis (every key of this run starts with ``keyprefix``) or RabbitMQ
    keyprefix: str
    queue: str
    store_url: str  # the lease store as the workers reach it (through the proxy for servers)
    receiver_url: str
    events_key: str  # the Redis list (in ``backend_url``'s database) holding the event log
    flags_dir: str
    harness_pid: int  # workers kill themselves when this process is gone (no orphans)
    #: The Redis database of the result backend and the event log (the broker's, on Redis).
    backend_url: str = "redis://127.0.0.1:6379/15"
    ttl: float = 2.0
    heartbeat: float = 0.5
    sweep_interval: float = 1.0
    #: ``lease_sweep_grace`` where the library has it: how long a sweep mark (or an unclaimed
    #: ready row) waits before the row is re-published again. Short, so that a run of two
    #: minutes can see the recovery of a sweeper killed between its mark and its re-publish.
    sweep_grace: float = 6.0
    visibility_timeout: float = 3600.0
    max_attempts: int = 10
    max_takeovers: int = 5
    variant: str = "plain"  # one of VARIANTS
    #: The Django project's database (``django-tx``: its ``DATABASES["default"]``, as the
    #: workers reach it), a ``postgresql://`` URL naming the run's schema and tag.
    database_url: str = ""
    #: Further Celery / lease_* settings for the workers' app (``--conf name=value``).
    extra_conf: dict[str, Any] = field(default_factory=dict)

    def to_env(self) -> dict[str, str]:
        env = {}
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            env[_PREFIX + item.name.upper()] = (json.dumps(value) if item.name == "extra_conf"
                                                else str(value))
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ChaosConfig:
        """Read the config back; ``KeyError`` names the first missing variable."""
        values: dict[str, Any] = {}
        for item in dataclasses.fields(cls):
            name = _PREFIX + item.name.upper()
            if name not in environ:
                if item.default is dataclasses.MISSING and item.name != "extra_conf":
                    raise KeyError(f"{name} is not set: start chaos workers with "
                                   "python -m benchmarks.chaos")
                continue
            raw = environ[name]
            kind = {"ttl": float, "heartbeat": float, "sweep_interval": float, "sweep_grace": float,
                    "visibility_timeout": float, "max_attempts": int, "max_takeovers": int,
                    "harness_pid": int}.get(item.name)
            if item.name == "extra_conf":
                values[item.name] = json.loads(raw)
            else:
                values[item.name] = kind(raw) if kind is not None else raw
        return cls(**values)

    def celery_conf(self) -> dict[str, Any]:
        """Broker and result backend settings both sides use."""
        redis_broker = self.broker_url.startswith("redis")
        if self.broker_url.startswith("sqs"):
            from ..sqs_server import transport_options

            options = transport_options(self.visibility_timeout)
        else:
            options = {
                "global_keyprefix": self.keyprefix,
                # Long by default, as in production: recovery must come from the lease rows
                # (the sweeper), not from the broker handing unacked messages out again.
                "visibility_timeout": self.visibility_timeout,
                "unacked_restore_interval": 1,
                "unacked_restore_throttle": 1,
            } if redis_broker else {}
        return {
            "broker_url": self.broker_url,
            "result_backend": self.backend_url,
            "task_default_queue": self.queue,
            # One prefix for every Redis key of the run (broker and results): cleanup deletes
            # exactly these, and runs (or the test suite's databases) never see each other's.
            "broker_transport_options": options,
            "result_backend_transport_options": {"global_keyprefix": self.keyprefix},
            "result_expires": 3600,
            "task_serializer": "json",
            "result_serializer": "json",
            "accept_content": ["json"],
            "broker_connection_retry_on_startup": True,
        }
