"""Chaos harness with a history checker: real workers, real faults, a verdict from what happened.

``python -m benchmarks.chaos --store sqlite|postgres|redis|mysql``; see README.md in this directory.

Modules, each owning one thing:

- ``config``: the environment contract between the harness and its worker processes
- ``events``: the event log (a Redis list) that workers and the harness append to
- ``flags``: fault tickets (files) the harness arms and worker processes consume
- ``app``: the Celery app the workers run (tasks); ``hooks``: its recording and fault hooks
- ``receiver``: the outside service, a process that records every request it gets
- ``proxy``: a loopback TCP proxy that can delay a store's replies
- ``sandbox``: isolated stores and broker keys, connection kills, cleanup
- ``workers``: starting, killing and supervising worker process groups
- ``faults``: the fault plan and the thread that injects it
- ``publish``: the publication plan (originals and duplicates) and its thread
- ``history``: reading everything back after the run; ``checker``: the verdict (pure)
- ``tally``: the numbers of the table; ``report``: the table printed
- ``run``: the orchestration; ``__main__``: the command line
"""
