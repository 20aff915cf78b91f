"""TCP proxies on loopback: one a test can cut, to take a real server out of reach; one that
loses the reply to a statement the server applied (ReplyDroppingProxy)."""

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


class ReplyDroppingProxy:
    """A TCP proxy on 127.0.0.1 in front of the test PostgreSQL. Once armed with a byte
    pattern, it forwards the next client message containing it, waits until the server has
    answered it completely (ReadyForQuery: the autocommit statement has committed), then cuts
    that client connection instead of passing the answer on: the reply is lost."""

    READY = b"Z\x00\x00\x00\x05"

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.dropped = 0
        self._pattern: bytes | None = None
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def drop_reply_to(self, pattern: bytes) -> None:
        with self._lock:
            self._pattern = pattern

    def disarm(self) -> None:
        """Lose no reply after all (the armed pattern was not sent)."""
        with self._lock:
            self._pattern = None

    def close(self) -> None:
        self.listener.close()
        for sock in self._sockets:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self._sockets += [client, server]
            armed = threading.Event()
            threading.Thread(target=self._to_server, args=(client, server, armed),
                             daemon=True).start()
            threading.Thread(target=self._to_client, args=(server, client, armed),
                             daemon=True).start()

    @staticmethod
    def _recv(sock: socket.socket) -> bytes:
        try:
            return sock.recv(65536)
        except OSError:
            return b""

    def _to_server(self, client: socket.socket, server: socket.socket,
                   armed: threading.Event) -> None:
        while data := self._recv(client):
            with self._lock:
                if self._pattern is not None and self._pattern in data:
                    self._pattern = None
                    armed.set()  # before forwarding: the answer is swallowed from its start
            try:
                server.sendall(data)
            except OSError:
                break
        self._cut(client, server)

    def _to_client(self, server: socket.socket, client: socket.socket,
                   armed: threading.Event) -> None:
        swallowed = b""
        while data := self._recv(server):
            if armed.is_set():
                swallowed += data
                if self.READY in swallowed:
                    with self._lock:
                        self.dropped += 1
                    break
                continue
            try:
                client.sendall(data)
            except OSError:
                break
        self._cut(client, server)

    @staticmethod
    def _cut(*socks: socket.socket) -> None:
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
