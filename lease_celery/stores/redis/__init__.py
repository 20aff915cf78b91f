"""Redis store, for deployments whose shared state already lives in Redis: the store
(``store``), its URL options (``options``), its script caller (``wire``) and its Lua scripts
(``lua``, one file a script in ``scripts/``)."""

from __future__ import annotations

from .store import RedisStore

__all__ = ["RedisStore"]
