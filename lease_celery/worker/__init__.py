"""The worker's own machinery, above the task's path: its lifecycle (start checks,
shutdown), the lease sweeper, the time limits."""
