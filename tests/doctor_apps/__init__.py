"""Small Celery apps for ``celery -A tests.doctor_apps.<name> leases doctor`` (test_doctor.py).

The lease store comes from ``DOCTOR_STORE`` (a URL the test chooses); nothing here connects to
the broker.
"""
