"""``python -m lease_celery``: the ``celery leases`` commands without the celery program."""

from .cli import main

main(prog_name="python -m lease_celery")
