"""Lease stores: the only code that talks to a database."""

from ..checks import MAX_KEY_LENGTH
from .base import Store
from .registry import open_store, register_scheme

__all__ = ["MAX_KEY_LENGTH", "Store", "open_store", "register_scheme"]
