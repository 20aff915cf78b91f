"""One worker process's machinery under the tasks it runs: the lease handle a body sees
(``handle``), the heartbeat that renews it, green-thread support, the history writer."""
