"""Exactly-once database effects, one runnable example per kind of app connection
(docs/transactions.md)."""
