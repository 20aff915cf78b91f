"""Real OS threads for the heartbeat and the sweeper under green pools (``-P gevent|eventlet``).

Celery monkey-patches the worker before it imports the app: every ``threading.Thread`` is then
a greenlet, and a body that never yields (CPU-bound work) would stop every renewal in the
worker. So under monkey-patching (``active()``) the heartbeat's threads and the sweeper run on
real OS threads (``start_thread``), which the GIL keeps switching to whatever the hub is doing.

The hard part is what those threads touch. A green primitive is not safe across OS threads:
eventlet's locks wake their waiters through the hub of the thread that releases them
(``greenlet.error``, and a waiter that never wakes), and a gevent lock or socket shared by a
greenlet and a native thread starved the greenlets or hung (a SQLite store's lock) when tried
here. So a native thread here touches nothing a greenlet holds:

- hand-offs with task code use real primitives (``lock``, ``Condition``, ``Event``,
  ``simple_queue``) held only for a few statements that never yield, so a greenlet that meets
  one held blocks the hub for microseconds, never across a switch;
- store calls go to a store of the thread's own (``thread_store``: the same URL, opened in
  that thread, so its sockets, pool and green locks belong to that thread's own hub; gevent and
  eventlet give each OS thread a hub of its own), never to the store the tasks share;
- our signals sent from such a thread, and the log records that reach a handler there (every
  handler configured when the first such thread starts), are handed to the hub (``to_hub``: a
  real deque that a greenlet drains), so receivers, metrics and log handlers run where they
  always ran, under the locks they were made with;
- the sweeper publishes on a broker connection of its own, and a fire-and-forget finish is
  written by the task's greenlet (heartbeat.py, sweeper.py).

What remains: a C extension that holds the GIL longer than the ttl stops these threads too
(the GIL does not switch inside it); a body that never yields still stops every other greenlet
(a claim whose reply it holds unread is renewed by the heartbeat meanwhile: claims.py);
Celery's own publish signals from the sweeper's re-publish run on its thread.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import logging
import sys
import threading
import time
from _queue import SimpleQueue
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar, cast

__all__ = ["Condition", "Event", "NativeThread", "active", "close_thread_stores", "lock",
           "on_native_thread", "per_thread", "simple_queue", "start_thread", "thread_store",
           "to_hub"]

S = TypeVar("S")

logger = logging.getLogger(__name__)

#: How often the hub looks for what native threads handed it (signals, log records).
RELAY_INTERVAL = 0.05


def active() -> str | None:
    """``"gevent"`` or ``"eventlet"`` when that library monkey-patched threading, else None.
    (Neither library is imported for asking.)"""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("threading"):
        return "gevent"
    patcher = sys.modules.get("eventlet.patcher")
    if patcher is not None and patcher.is_monkey_patched("thread"):
        return "eventlet"
    return None


_originals: dict[tuple[str | None, str, str], Any] = {}


def _original(module: str, name: str) -> Any:
    """``module.name`` as it was before monkey-patching."""
    library = active()
    found = _originals.get((library, module, name))
    if found is not None:
        return found
    if library == "gevent":
        from gevent.monkey import get_original

        found = get_original(module, name)
    elif library == "eventlet":
        from eventlet import patcher

        found = getattr(patcher.original(module), name)
    else:
        found = getattr(importlib.import_module(module), name)
    _originals[library, module, name] = found
    return found


def lock() -> Any:
    """A real lock (``threading.Lock`` when nothing is patched)."""
    return _original("_thread", "allocate_lock")()


def simple_queue() -> SimpleQueue[Any]:
    """A real ``queue.SimpleQueue``: the C one, which neither library patches."""
    return SimpleQueue()


class Condition:
    """``threading.Condition`` on a real re-entrant lock, with real waiter locks (under gevent,
    the stdlib class would make its waiters from the patched ``_allocate_lock``)."""

    def __init__(self) -> None:
        self._lock = _original("_thread", "RLock")()
        self._allocate = _original("_thread", "allocate_lock")
        self._waiters: collections.deque[Any] = collections.deque()

    def __enter__(self) -> bool:
        return bool(self._lock.acquire())

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        waiter = self._allocate()
        waiter.acquire()
        self._waiters.append(waiter)
        saved = self._lock._release_save()
        woken = False
        try:
            woken = bool(waiter.acquire(True, -1 if timeout is None else max(timeout, 0.0)))
            return woken
        finally:
            self._lock._acquire_restore(saved)
            if not woken:
                with contextlib.suppress(ValueError):  # notified as it timed out
                    self._waiters.remove(waiter)

    def notify(self, n: int = 1) -> None:
        for _ in range(min(n, len(self._waiters))):
            self._waiters.popleft().release()

    def notify_all(self) -> None:
        self.notify(len(self._waiters))


class Event:
    """``threading.Event`` on :class:`Condition`."""

    def __init__(self) -> None:
        self._condition = Condition()
        self._flag = False

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        with self._condition:
            self._flag = True
            self._condition.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        with self._condition:
            if not self._flag:
                self._condition.wait(timeout)
            return self._flag


class NativeThread:
    """A started thread: real under monkey-patching, a daemon ``threading.Thread`` otherwise."""

    def __init__(self, target: Callable[[], None], name: str) -> None:
        self.name = name
        self._done = Event()
        self._target = target
        if active() is None:
            self._thread: threading.Thread | None = threading.Thread(
                target=target, name=name, daemon=True)
            self._thread.start()
            return
        self._thread = None
        _install_relay()
        _original("_thread", "start_new_thread")(self._run, ())

    def _run(self) -> None:
        _native.add(_original("_thread", "get_ident")())
        try:
            self._target()
        finally:
            self._done.set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            self._done.wait(timeout)


def start_thread(target: Callable[[], None], *, name: str) -> NativeThread:
    """Run ``target`` on a thread of its own; under monkey-patching, a real OS thread (start
    it from the hub's thread: the first one installs the relay there)."""
    return NativeThread(target, name)


# -- what native threads hand to the hub ------------------------------------------------------

_native: set[int] = set()  # real idents of the threads start_thread made under patching
_pending: collections.deque[Callable[[], Any]] = collections.deque()  # append/popleft: atomic
_relay_installed = False


def on_native_thread() -> bool:
    """Is this one of the real OS threads ``start_thread`` made under monkey-patching?"""
    return bool(_native) and _original("_thread", "get_ident")() in _native


def to_hub(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
    """Call ``fn`` now, or, on a native thread, soon on the hub (in order, errors logged)."""
    if on_native_thread():
        _pending.append(functools.partial(fn, *args, **kwargs))
    else:
        fn(*args, **kwargs)


def _drain() -> None:
    """The hub's side: a greenlet that runs what native threads handed over. It polls (a
    green sleep) instead of being woken: waking a hub from another OS thread is exactly the
    cross-thread call this module avoids."""
    while True:
        time.sleep(RELAY_INTERVAL)
        while _pending:
            call = _pending.popleft()
            try:
                call()
            except Exception:
                logger.exception("lease_celery: a call handed to the hub failed")


def _send_on_hub(send: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if on_native_thread():
        _pending.append(functools.partial(send, *args, **kwargs))
        return []
    return send(*args, **kwargs)


class _RelayFilter(logging.Filter):
    """On a handler: a record that reaches it on a native thread is handled on the hub
    (``Handler.handle`` filters before it takes the handler's lock, a green one)."""

    def __init__(self, handler: logging.Handler) -> None:
        super().__init__()
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        if on_native_thread():
            _pending.append(functools.partial(self.handler.handle, record))
            return False
        return True


def _install_relay() -> None:
    """Once, on the hub's thread: start the draining greenlet, route our signals through it,
    and put the relay filter on every log handler configured by now."""
    global _relay_installed
    if _relay_installed:
        return
    if on_native_thread():
        raise RuntimeError("lease_celery.runtime.green: start native threads from the hub's thread")
    _relay_installed = True
    if active() == "gevent":
        import gevent

        gevent.spawn(_drain)
    else:
        import eventlet

        eventlet.spawn_n(_drain)
    from celery.utils.dispatch import Signal

    from .. import signals

    for signal in vars(signals).values():
        if isinstance(signal, Signal):
            # An instance attribute shadows Signal.send: receivers run on the hub.
            signal.send = functools.partial(_send_on_hub, signal.send)
    loggers = [logging.getLogger()] + [
        item for name, item in logging.root.manager.loggerDict.items()
        if isinstance(item, logging.Logger)]
    for item in loggers:
        for handler in item.handlers:
            if not any(isinstance(f, _RelayFilter) for f in handler.filters):
                handler.addFilter(_RelayFilter(handler))
        if item.name.startswith("lease_celery"):
            # Fill the level cache now: a miss takes logging's module lock (a green one).
            for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR):
                item.isEnabledFor(level)


# -- stores -----------------------------------------------------------------------------------

# (native thread ident, id(store)) → (store, its copy): holding the store keeps its id unique.
_own_stores: dict[tuple[int, int], tuple[Any, Any]] = {}


def thread_store(store: S) -> S:
    """The store to use from this thread: ``store`` itself, except on a native thread, where
    it is a copy opened in (and only used by) this thread, on the same URL and clock.

    An in-memory SQLite store has no copy (another connection is another database): it is
    shared, as ``doctor`` already reports it unusable for workers."""
    if not on_native_thread():
        return store
    url = getattr(store, "url", None)
    if not isinstance(url, str) or url.rstrip("/") in ("sqlite:", "sqlite:/:memory:"):
        return store
    key = (_original("_thread", "get_ident")(), id(store))
    found = _own_stores.get(key)
    if found is None:
        from ..stores.registry import open_store

        found = _own_stores[key] = (store, open_store(url, clock=getattr(store, "_clock", None)))
    return cast(S, found[1])


def close_thread_stores() -> None:
    """Close the copies ``thread_store`` opened for the calling thread (call it there)."""
    ident = _original("_thread", "get_ident")()
    for key in [key for key in _own_stores if key[0] == ident]:
        try:
            _own_stores.pop(key)[1].close()
        except Exception:
            logger.exception("lease_celery: a thread's own store did not close")


class _PerThread:
    def __init__(self, store: Any) -> None:
        self.store = store

    def __getattr__(self, name: str) -> Any:
        # Looked up at each call, on the calling thread: a copy that cannot be opened fails
        # that call (a StoreError the caller handles like any other).
        return getattr(thread_store(self.store), name)


def per_thread(store: S) -> S:
    """``store``; under monkey-patching, a stand-in whose calls go to the calling thread's
    ``thread_store(store)`` (for work that any of several threads may pick up)."""
    return store if active() is None else cast(S, _PerThread(store))
