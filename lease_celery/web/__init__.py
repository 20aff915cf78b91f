"""A web dashboard over a lease store: ``celery -A proj leases web``, or mount the WSGI app.

``make_app(store_url, token=...)`` returns a WSGI application for any WSGI server (gunicorn,
waitress, uWSGI, wsgiref) or a Flask/Django mount under a URL prefix (``SCRIPT_NAME``). Plain
server-rendered HTML, no scripts: pages reload themselves; actions (resolve or discard a
receipt, requeue a dead key) need the operator token and are recorded in the key's history.
Without a token the dashboard is read-only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..stores.registry import open_store
from .app import WebApp

__all__ = ["WebApp", "make_app"]


def make_app(store_url: str, *, token: str | None = None, app: Any = None,
             allowed_hosts: Sequence[str] | None = None, refresh: int = 5,
             secret: str | bytes | None = None, protect_reads: bool = False) -> WebApp:
    """The dashboard over the store at ``store_url`` (see :class:`WebApp` for the options).

    The store is opened once (connecting lazily) and shared by the requests; ``.close()``
    closes it.
    """
    return WebApp(open_store(store_url), token=token, app=app, allowed_hosts=allowed_hosts,
                  refresh=refresh, secret=secret, protect_reads=protect_reads)
