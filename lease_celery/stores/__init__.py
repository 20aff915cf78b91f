"""Lease stores: the only code that talks to a database."""

from .base import MAX_KEY_LENGTH, Store, open_store, register_scheme

__all__ = ["MAX_KEY_LENGTH", "Store", "open_store", "register_scheme"]
