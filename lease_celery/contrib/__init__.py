"""Integrations with frameworks the core does not import (each needs its own extra)."""
