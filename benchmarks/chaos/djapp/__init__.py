"""The Django project of the ``django-tx`` chaos variant: its settings (``settings.py``) and one
app, ``chaos_shop`` (an order and its payment per job, written by the job body inside
``self.lease.atomic()``).

Imported by the workers and the harness's ``migrate`` of that variant only: nothing else in
the harness (nor ``lease_celery``) imports Django.
"""
