"""A TCP proxy on loopback that a test can cut, to take a real server out of reach."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


class CuttableProxy:
    """Forwards 127.0.0.1:<port> to a target; ``cut()`` drops every connection and refuses new
    ones, as a server that went away would; ``down()`` does the same until ``up()``, as a
    server that restarts."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._cut = False
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def down(self) -> None:
        """Drop every connection and stop listening: a connect is refused (ECONNREFUSED)."""
        with self._lock:
            self._drop()

    def up(self) -> None:
        """Listen on the same port again (after ``down()``)."""
        with self._lock:
            self._listener = socket.create_server(("127.0.0.1", self.port))
            threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def _drop(self) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self._sockets.clear()
        # shutdown() first: close() alone leaves a thread blocked in accept() holding the
        # socket, and the kernel would go on accepting connections on it.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                if self._cut:
                    client.close()
                    continue
                upstream = socket.create_connection(self.target)
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            self._drop()


@contextlib.contextmanager
def cuttable_proxy(host: str, port: int) -> Iterator[CuttableProxy]:
    proxy = CuttableProxy(host, port)
    try:
        yield proxy
    finally:
        proxy.cut()
