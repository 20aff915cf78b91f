"""A loopback TCP proxy between the workers and a store server that can delay its replies.

Bytes from a worker reach the server at once; bytes from the server are held ``delay`` seconds
(settable at any time) before they are passed on. So the server judges every request on its
own clock when it arrives, and only the answer comes back late: exactly a store whose replies
are slow. Replies are scheduled, not slept on one after another: a chunk received at ``t``
leaves at ``t + delay`` (and never before an earlier chunk of the same connection), so a burst
of replies is not slowed by more than ``delay``.

Runs as threads in the harness process; ``close()`` drops every connection.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import time

__all__ = ["DelayingProxy"]

#: Seconds to wait for the real server when a worker connects through the proxy.
CONNECT_TIMEOUT = 5.0


class DelayingProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.delay = 0.0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="chaos-proxy", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=CONNECT_TIMEOUT)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._closed:
                    client.close()
                    upstream.close()
                    return
                self._sockets |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._delayed_pump, args=(upstream, client),
                             daemon=True).start()

    def _forget(self, *sockets: socket.socket) -> None:
        with self._lock:
            for sock in sockets:
                if sock in self._sockets:
                    self._sockets.discard(sock)
                    _shut(sock)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def _delayed_pump(self, source: socket.socket, sink: socket.socket) -> None:
        queue: collections.deque[tuple[float, bytes]] = collections.deque()
        ready = threading.Condition()
        done = threading.Event()

        def forward() -> None:
            with contextlib.suppress(OSError):
                while True:
                    with ready:
                        while not queue and not done.is_set():
                            ready.wait(1.0)
                        if not queue:
                            break
                        due, data = queue.popleft()
                    pause = due - time.monotonic()
                    if pause > 0:
                        time.sleep(pause)
                    sink.sendall(data)
            # The server closed (a killed connection): close the worker's side too, after the
            # replies already on their way, as a real server's FIN would arrive.
            self._forget(sink, source)

        sender = threading.Thread(target=forward, daemon=True)
        sender.start()
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                with ready:
                    queue.append((time.monotonic() + self.delay, data))
                    ready.notify()
        done.set()
        with ready:
            ready.notify()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._sockets = list(self._sockets), set()
        with contextlib.suppress(OSError):
            self._listener.close()
        for sock in sockets:
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    """Shut down, then close. ``close()`` alone does not wake a ``recv`` blocked on the socket
    in another thread, and while that ``recv`` holds it no FIN is sent: the worker on the
    other end would wait for ever on a connection the server has already dropped."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
