"""A TCP proxy on loopback that delays the server's replies: a slow store, switchable at runtime.

Bytes from the client reach the server at once; bytes from the server are held for ``delay``
seconds (set ``proxy.delay`` at any time) before they are passed on. Replies are scheduled, not
slept on one after another: a reply received at ``t`` is forwarded at ``t + delay`` (and never
before an earlier reply of the same connection), so a pipeline of requests is not slowed down
more than ``delay`` each. The server sees every request as soon as it is sent, so its clock
judges it at once: exactly a store whose answers come back late.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

from tests.proxy import CuttableProxy


class DelayingProxy(CuttableProxy):
    """``CuttableProxy`` whose server-to-client direction is delayed by ``delay`` seconds."""

    def __init__(self, target_host: str, target_port: int, *, delay: float = 0.0) -> None:
        self.delay = delay
        super().__init__(target_host, target_port)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self._cut:
                    client.close()
                    continue
                upstream = socket.create_connection(self.target)
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._delayed_pump, args=(upstream, client),
                             daemon=True).start()

    def _delayed_pump(self, source: socket.socket, sink: socket.socket) -> None:
        queue: collections.deque[tuple[float, bytes]] = collections.deque()
        ready = threading.Condition()
        done = threading.Event()

        def forward() -> None:
            with contextlib.suppress(OSError):
                while True:
                    with ready:
                        while not queue and not done.is_set():
                            ready.wait()
                        if not queue:
                            break
                        due, data = queue.popleft()
                    pause = due - time.monotonic()
                    if pause > 0:
                        time.sleep(pause)
                    sink.sendall(data)
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

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


@contextlib.contextmanager
def delaying_proxy(host: str, port: int, *, delay: float = 0.0) -> Iterator[DelayingProxy]:
    proxy = DelayingProxy(host, port, delay=delay)
    try:
        yield proxy
    finally:
        proxy.cut()
