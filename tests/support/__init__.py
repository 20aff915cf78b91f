"""Helpers and Celery apps the tiers share (servers, worker pools, proxies, test apps)."""
