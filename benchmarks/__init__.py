"""Benchmarks and the chaos harness (``python -m benchmarks.chaos``); not part of the library."""
