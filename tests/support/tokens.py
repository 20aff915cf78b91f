"""Where a store's token and fence numbers start.

The SQL stores count from 1. The Redis store counts from above its epoch's floor (the epoch's
creation time in microseconds on the store's clock; see ``Store.epoch``): its first token of a
key is ``floor + 1``, and each claim adds one as on every store. Tests compare tokens and fences
as ``token_base(store) + N``.
"""

from __future__ import annotations

from lease_celery import Store, open_store
from lease_celery.stores.base import Clock


def token_base(store_or_url: Store | str, *, clock: Clock | None = None) -> int:
    """The number a store's tokens and fences count up from: its epoch's floor, 0 without one.

    Given a URL, a store is opened on it (with ``clock``, as the test's own stores are: the
    epoch of a new Redis prefix is created by its first store, on that store's clock) and
    closed again.
    """
    if isinstance(store_or_url, str):
        store = open_store(store_or_url, clock=clock)
        try:
            return token_base(store)
        finally:
            store.close()
    epoch = store_or_url.epoch()
    return 0 if epoch is None else epoch.floor
