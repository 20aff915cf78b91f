"""The variants of ``worker_throughput.py``, for the harness and its workers' app alike."""

from __future__ import annotations

__all__ = ["BUSY", "CARRIED", "DEFAULT_VARIANTS", "INLINE", "NO_HISTORY", "VARIANTS"]

#: The variants a run measures by default.
DEFAULT_VARIANTS = ("plain", "sqlite", "postgres", "redis", "mysql", "once", "singleton")
#: Also known: a store with its history triggers dropped after the warm-up, so that the same
#: run measures what the store's history costs a task (``plain,sqlite,sqlite-nohistory``).
NO_HISTORY = {"sqlite-nohistory": "sqlite", "postgres-nohistory": "postgres"}
#: Also known: a store's tasks with every finish written in the task
#: (``lease_finish_in_background=False``), on the same store, so that one run measures what
#: the finish behind the return (carried by the next claim, or sent) changes
#: (``plain,sqlite,sqlite-inline``).
INLINE = {"sqlite-inline": "sqlite", "postgres-inline": "postgres", "redis-inline": "redis"}
#: Also known: a store's tasks whose every finish behind the return is carried by the next
#: claim, however long the body ran ("auto" carries only bodies under 2 ms: the worker raises
#: ``BACKGROUND_AFTER``), so that one run measures what that threshold buys a 10 ms body
#: (``--body 10ms plain,postgres,postgres-carried``).
CARRIED = {"sqlite-carried": "sqlite", "postgres-carried": "postgres",
           "redis-carried": "redis"}
#: Also known: plain Celery tasks (no lease) whose body first spends this many µs of CPU in a
#: busy loop, about what a LeasedTask adds to a pool process per task: their rate falls toward
#: the lease variants', so that one run measures what the worker's main process and its pool
#: cost per task at that rate with no lease_celery in them (``plain,redis,plain-busy``).
BUSY = {"plain-busy": 400}
#: Every variant, in the order a run reports them.
VARIANTS = (*DEFAULT_VARIANTS, *NO_HISTORY, *INLINE, *CARRIED, *BUSY)
