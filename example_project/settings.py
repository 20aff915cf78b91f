"""Celery settings of the example app, read with ``app.config_from_object``.

One module for every deployment: what differs between machines comes from the environment.
The defaults are embedded, so nothing has to be installed: kombu's filesystem transport as
the broker, ``file://`` as the result backend and a SQLite file as the lease store, all under
``EXAMPLE_DATA_DIR``. The demo sets the variables; ``python -m example_project demo --broker
redis://…`` only changes ``EXAMPLE_BROKER_URL``.
"""

from __future__ import annotations

import os

DATA_DIR = os.path.abspath(os.environ.get("EXAMPLE_DATA_DIR", "example-data"))

broker_url = os.environ.get("EXAMPLE_BROKER_URL", "filesystem://")
if broker_url.startswith("filesystem://"):
    # kombu's own, except that a message is written whole before a worker can read it.
    broker_transport = "example_project.broker:Transport"
    broker_transport_options = {
        "data_folder_in": os.path.join(DATA_DIR, "broker"),
        "data_folder_out": os.path.join(DATA_DIR, "broker"),
        "control_folder": os.path.join(DATA_DIR, "broker-control"),
        # The transport polls its folder; the default (1 s) would make every hand-over slow.
        "polling_interval": 0.1,
    }
result_backend = f"file://{os.path.join(DATA_DIR, 'results')}"
task_default_queue = os.environ.get("EXAMPLE_QUEUE", "reports")

# At-least-once delivery: a message is acked only after its task ran, and a pool process that
# dies mid-task gets its message rejected back to the broker (where the broker can).
task_acks_late = True
task_reject_on_worker_lost = True
# A worker fetches only what it can run now: a busy worker never sits on a second message.
worker_prefetch_multiplier = 1

# The lease: short, so that the demo's takeovers happen in seconds, not minutes.
lease_store_url = os.environ.get(
    "EXAMPLE_STORE_URL", f"sqlite:///{os.path.join(DATA_DIR, 'leases.sqlite3')}")
lease_ttl = 2.0
lease_heartbeat_interval = 0.5
# Every worker's main process runs a sweeper thread: a lease that expired without renewal (its
# owner died) gets the task recorded on its row re-published, once per expired token. Unset =
# lease_celery's default, half the smallest lease_ttl (1 s here); 0 turns it off (the demo does
# that for the plain run's workers: a plain Celery deployment has no sweeper).
lease_sweep_interval = (float(os.environ["EXAMPLE_SWEEP_INTERVAL"])
                        if os.environ.get("EXAMPLE_SWEEP_INTERVAL") else None)

# The app's own settings (read by the tasks through ``app.conf``).
#: Where finished reports are published: an outside service this app does not control.
reports_endpoint = os.environ.get("EXAMPLE_REPORTS_ENDPOINT", "http://127.0.0.1:8765/reports")
#: The plain task's result table (the LeasedTask's results live in the lease store).
reports_db = os.path.join(DATA_DIR, "reports.sqlite3")
#: How long building one report takes (seconds of pretend work).
report_build_seconds = float(os.environ.get("EXAMPLE_BUILD_SECONDS", "1.0"))
