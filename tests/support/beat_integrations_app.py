"""tests/support/beat_app.py's Celery app, configured for the third-party schedulers that
tests/workers/test_beat_integrations.py runs in real ``celery beat`` processes.

``LEASE_TEST_BEAT_REDBEAT_PREFIX`` set: redbeat keeps its schedule under that key prefix in
the broker's Redis database, with its lock off (``redbeat_lock_key=None``, what a highly
available pair of beats runs with). ``LEASE_TEST_BEAT_DJANGO_DB`` set: Django is set up on
tests/support/beat_django/settings.py, and the schedule is only what the test put in the database
(an empty ``beat_schedule``: DatabaseScheduler would otherwise write the app's entry there).
The scheduler classes are the ones ``lease_celery.beat`` ships, and the plain ones.
"""

from __future__ import annotations

import os

from tests.support.beat_app import BROKER, app

__all__ = ["app"]

if os.environ.get("LEASE_TEST_BEAT_MAX_INTERVAL"):
    app.conf.beat_max_loop_interval = float(os.environ["LEASE_TEST_BEAT_MAX_INTERVAL"])

if os.environ.get("LEASE_TEST_BEAT_REDBEAT_PREFIX"):
    app.conf.update(redbeat_redis_url=os.environ.get("LEASE_TEST_BEAT_REDBEAT_URL", BROKER),
                    redbeat_key_prefix=os.environ["LEASE_TEST_BEAT_REDBEAT_PREFIX"],
                    redbeat_lock_key=None)

if os.environ.get("LEASE_TEST_BEAT_DJANGO_DB"):
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.support.beat_django.settings")
    django.setup()
    app.conf.beat_schedule = {}
