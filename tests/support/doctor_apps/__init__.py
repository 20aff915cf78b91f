"""Small Celery apps for ``celery -A tests.support.doctor_apps.<name> leases doctor``
(tests/stores/test_doctor.py).

The lease store comes from ``DOCTOR_STORE`` (a URL the test chooses); nothing here connects to
the broker.
"""
