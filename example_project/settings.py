"""Celery settings for the example app, read with ``app.config_from_object``.

Everything is embedded: the broker is kombu's filesystem transport and the lease store a SQLite
file, both under ``EXAMPLE_DATA_DIR`` (set by the demo runner), so no server is needed.
"""

import os

DATA_DIR = os.environ.get("EXAMPLE_DATA_DIR", os.path.abspath("example-data"))

broker_url = os.environ.get("EXAMPLE_BROKER_URL", "filesystem://")
broker_transport_options = {
    "data_folder_in": os.path.join(DATA_DIR, "broker"),
    "data_folder_out": os.path.join(DATA_DIR, "broker"),
    "control_folder": os.path.join(DATA_DIR, "broker-control"),
}
result_backend = os.environ.get("EXAMPLE_RESULT_BACKEND", f"file://{DATA_DIR}/results")
task_acks_late = True
task_reject_on_worker_lost = True
worker_prefetch_multiplier = 1

lease_store_url = os.environ.get("EXAMPLE_STORE_URL", f"sqlite:///{DATA_DIR}/leases.sqlite3")
lease_ttl = 3.0
lease_heartbeat_interval = 1.0
