"""The CLI's server, loopback by default: waitress (``pip install 'lease-celery[web]'``), whose
fixed pool of threads serves requests while idle connections wait in its event loop and are
closed after ``CHANNEL_TIMEOUT``; without it, on loopback only, the stdlib's wsgiref (a thread
per connection, held as long as the client keeps it open).

A non-loopback ``host`` is refused without an operator token (with one, a loud warning says
what is exposed, and every page needs the token). On loopback the ``Host`` header must name
loopback too, so a page served from elsewhere cannot read the dashboard through DNS
rebinding.
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

__all__ = ["CHANNEL_TIMEOUT", "THREADS", "is_loopback", "serve"]

#: waitress: requests served at once, and seconds an idle connection is kept.
THREADS, CHANNEL_TIMEOUT = 8, 30


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
    try:
        server = _server(web, host, port, loopback, announce)
    except OSError as exc:
        web.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}") from exc
    except ConfigError:
        web.close()
        raise
    shown = f"[{host.strip('[]')}]" if ":" in host else host
    mode = ("read-only (no --token)" if token is None
            else "every page and action needs the operator token" if protect_reads
            else "actions need the operator token")
    announce(f"lease_celery dashboard on http://{shown}:{server.port}/ "
             f"({mode}); Ctrl-C stops it")
    if not loopback:
        readable = ("every page needs the operator token, which" if protect_reads else
                    "every page (keys, reasons, results) is readable by whoever reaches the "
                    "port, and the operator token")
        announce(f"WARNING: listening on {host}, beyond this machine, over plain HTTP: "
                 f"{readable} crosses the network unencrypted. Put the dashboard behind "
                 "a TLS reverse proxy with its own authentication.")
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        web.close()


class _Running:
    """The one interface serve() needs of either server: its port, run until interrupted,
    close."""

    def __init__(self, port: int, run: Callable[[], None], close: Callable[[], None]) -> None:
        self.port, self.run, self.close = port, run, close


def _server(web: Any, host: str, port: int, loopback: bool,
            announce: Callable[[str], None]) -> _Running:
    try:
        from waitress.server import create_server
    except ImportError:
        if not loopback:
            raise ConfigError(f"serving the dashboard on {host!r}, beyond loopback, needs "
                              "waitress: pip install 'lease-celery[web]' (the stdlib's server "
                              "holds a thread per open connection, for as long as a client "
                              "keeps it open)") from None
        announce("note: serving with the stdlib's wsgiref (a thread per connection); "
                 "pip install 'lease-celery[web]' for waitress")
        server_class = _Server6 if ":" in host else _Server
        plain = make_server(host.strip("[]"), port, web, server_class=server_class,
                            handler_class=_Handler)
        return _Running(plain.server_address[1], plain.serve_forever, plain.server_close)
    served = create_server(web, host=host.strip("[]"), port=port, threads=THREADS,
                           channel_timeout=CHANNEL_TIMEOUT, cleanup_interval=5,
                           connection_limit=1000, ident="lease_celery")
    return _Running(int(served.effective_port), served.run, served.close)
