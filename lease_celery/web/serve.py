"""The CLI's server: the stdlib's wsgiref, one thread per request, loopback by default.

A non-loopback ``host`` is refused without an operator token (with one, a loud warning says
what is exposed). On loopback the ``Host`` header must name loopback too, so a page served
from elsewhere cannot read the dashboard through DNS rebinding.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from ..errors import ConfigError
from . import make_app
from .app import LOOPBACK_NAMES

__all__ = ["is_loopback", "serve"]


def is_loopback(host: str) -> bool:
    """``localhost``, ``127.0.0.0/8`` and ``::1``; anything else (``0.0.0.0``, a name) is not."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(WSGIRequestHandler):
    """Logs actions and errors only: a page that reloads every few seconds is not news."""

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        status = int(code) if isinstance(code, int) or code.isdigit() else 0
        if self.command != "GET" or status >= 400:
            super().log_request(code, size)


def serve(store_url: str, *, host: str = "127.0.0.1", port: int = 8765,
          token: str | None = None, app: Any = None, protect_reads: bool | None = None,
          announce: Callable[[str], None] = print) -> None:
    """Serve the dashboard until interrupted. ``port`` 0 picks a free port (announced).
    ``protect_reads`` None: on beyond loopback (every page needs the token there)."""
    loopback = is_loopback(host)
    if protect_reads is None:
        protect_reads = not loopback
    if not loopback and token is None:
        raise ConfigError(
            f"refusing to serve the dashboard on {host!r}, which is not a loopback address, "
            "without an operator token: anyone who reaches it could read every key, reason "
            "and result. Use --host 127.0.0.1 (and an SSH tunnel or a reverse proxy), or give "
            "--token")
    if protect_reads and token is None:
        raise ConfigError("--protect-reads needs --token (or LEASE_WEB_TOKEN): the pages open "
                          "to whoever signs in with it")
    web = make_app(store_url, token=token, app=app, protect_reads=protect_reads,
                   allowed_hosts=[*LOOPBACK_NAMES, host] if loopback else ["*"])
    server_class = _Server6 if ":" in host else _Server
    try:
        server = make_server(host.strip("[]"), port, web, server_class=server_class,
                             handler_class=_Handler)
    except OSError as exc:
        web.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}") from exc
    shown = f"[{host.strip('[]')}]" if ":" in host else host
    mode = ("read-only (no --token)" if token is None
            else "every page and action needs the operator token" if protect_reads
            else "actions need the operator token")
    announce(f"lease_celery dashboard on http://{shown}:{server.server_address[1]}/ "
             f"({mode}); Ctrl-C stops it")
    if not loopback:
        readable = ("every page needs the operator token, which" if protect_reads else
                    "every page (keys, reasons, results) is readable by whoever reaches the "
                    "port, and the operator token")
        announce(f"WARNING: listening on {host}, beyond this machine, over plain HTTP: "
                 f"{readable} crosses the network unencrypted. Put the dashboard behind "
                 "a TLS reverse proxy with its own authentication.")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        web.close()
