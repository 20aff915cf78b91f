"""``python -m example_project demo``: see what lease_celery fixes, on embedded defaults.

Starts real ``celery worker`` processes (prefork) on kombu's filesystem broker, a SQLite lease
store and an outside HTTP service, then plays one failure story (a duplicate delivery, a lone
delivery whose worker is SIGKILLed mid-task, a worker stalled past its lease) twice: with a
plain Celery task and with ``LeasedTask``. Ends with a side-by-side table and a picture of the
lease timeline.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .demo.run import Options, main_entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m example_project", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="demo", choices=["demo"])
    parser.add_argument("--broker", metavar="URL",
                        help="broker URL, e.g. redis://127.0.0.1:6379/12 or "
                             "amqp://guest:guest@127.0.0.1:5672// (default: filesystem://)")
    parser.add_argument("--store", metavar="URL",
                        help="lease store URL (default: a SQLite file in the data directory)")
    parser.add_argument("--tasks", type=int, default=6, metavar="N",
                        help="reports in the workload, at least 3 (default: 6)")
    parser.add_argument("--mode", choices=["plain", "leased", "both"], default="both",
                        help="play the story with one task type only (default: both)")
    parser.add_argument("--data-dir", type=Path, metavar="DIR",
                        help="where broker folders, stores, logs and the picture go "
                             "(default: a new temporary directory)")
    parser.add_argument("--json", type=Path, metavar="FILE",
                        help="also write a machine-readable summary to FILE")
    args = parser.parse_args(argv)
    modes = ("plain", "leased") if args.mode == "both" else (args.mode,)
    return main_entry(Options(broker_url=args.broker, store_url=args.store, tasks=args.tasks,
                              modes=modes, data_dir=args.data_dir, json_path=args.json))


if __name__ == "__main__":
    sys.exit(main())
