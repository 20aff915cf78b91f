"""What lease_celery reads off a Celery app: which of its tasks are LeasedTasks.

The modules under the task's gate (the sweeper, the worker's wiring, time limits, doctor)
tell a LeasedTask from a plain task without importing ``LeasedTask``, whose module imports
them: the class carries a marker, and this module reads it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MARKER", "is_leased", "leased_tasks"]

#: The class attribute, True on ``LeasedTask`` and so on every subclass, that marks one.
MARKER = "__lease_celery_task__"


def is_leased(task: Any) -> bool:
    """Whether ``task`` (a task instance or class) is a LeasedTask."""
    klass = task if isinstance(task, type) else type(task)
    return getattr(klass, MARKER, False) is True


def leased_tasks(app: Any) -> list[Any]:
    """The app's LeasedTasks (finalizing the app, as ``app.tasks`` does)."""
    return [task for task in app.tasks.values() if is_leased(task)]
