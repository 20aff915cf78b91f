"""Optional dependencies: imported where they are used, and, when one is missing, an
ImportError that says what to install.

``pip install 'lease-celery[<extra>]'`` brings each extra's packages (pyproject.toml). Every
import of one goes through :func:`needs`, so the message reads the same everywhere::

    with needs("lease_celery.otel", "opentelemetry-api", extra="otel"):
        from opentelemetry import trace
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["install_command", "needs"]


def install_command(extra: str) -> str:
    """The command that installs ``extra``: ``pip install 'lease-celery[<extra>]'``."""
    return f"pip install 'lease-celery[{extra}]'"


@contextmanager
def needs(what: str, package: str, *, extra: str | None = None,
          if_broken: str | None = None) -> Iterator[None]:
    """The imports in this block are of ``package``, which ``what`` needs.

    An ImportError there is raised again (a ``ModuleNotFoundError`` stays one, with the same
    ``name``) as one naming what needs it, the original error (what exactly was not found) and
    the command to run: ``pip install 'lease-celery[<extra>]'``, or ``pip install <package>``
    for a package no extra brings. ``if_broken``: what to say instead when the package is
    installed but could not load (an ImportError that is not a ModuleNotFoundError: installing
    the extra again would not help). The original is chained as its cause.
    """
    try:
        yield
    except ImportError as exc:
        command = install_command(extra) if extra else f"pip install {package}"
        if if_broken is not None and not isinstance(exc, ModuleNotFoundError):
            command = if_broken
        kind = ModuleNotFoundError if isinstance(exc, ModuleNotFoundError) else ImportError
        raise kind(f"{what} needs {package} ({exc}): {command}", name=exc.name,
                   path=exc.path) from exc
