"""``python -m example_project [demo]``: run the example on embedded defaults, no server needed.

Starts a real ``celery worker`` (prefork) on kombu's filesystem broker and the SQLite lease
store, publishes every report twice (as a broker redelivery would), and prints what ran.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _events(data_dir: Path) -> list[dict[str, object]]:
    path = data_dir / "runs.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def demo(reports: int) -> int:
    data_dir = Path(tempfile.mkdtemp(prefix="lease-celery-demo-"))
    for sub in ("broker", "broker-control", "results"):
        (data_dir / sub).mkdir()
    os.environ["EXAMPLE_DATA_DIR"] = str(data_dir)
    from example_project.tasks import build_report  # reads EXAMPLE_DATA_DIR

    print(f"data in {data_dir}; starting a celery worker (prefork, 2 processes) …", flush=True)
    with open(data_dir / "worker.log", "wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "example_project.app", "worker",
             "-P", "prefork", "-c", "2", "-l", "warning", "--without-gossip", "--without-mingle"],
            env=os.environ.copy(), stdout=subprocess.DEVNULL, stderr=log)
    try:
        results = []
        for report_id in range(1, reports + 1):
            results.append(build_report.delay(report_id))
            build_report.delay(report_id)  # the same work delivered a second time
        print(f"published {reports} reports, each twice; waiting …", flush=True)
        accepted = [r.get(timeout=60) for r in results]
        time.sleep(2 * 3.0)  # let the deferred duplicates come back and drop out
    finally:
        worker.terminate()
        worker.wait(30)
    events = _events(data_dir)
    runs = [e for e in events if e["event"] == "body_start"]
    print(f"\n{'reports':>10} {'deliveries':>11} {'body runs':>10} {'accepted':>9}")
    print(f"{reports:>10} {2 * reports:>11} {len(runs):>10} {len(accepted):>9}")
    ok = len(runs) == reports and len(accepted) == reports
    print("\nevery report was built exactly once" if ok else "\nUNEXPECTED: see worker.log")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m example_project", description=__doc__)
    parser.add_argument("command", nargs="?", default="demo", choices=["demo"])
    parser.add_argument("--reports", type=int, default=3)
    args = parser.parse_args(argv)
    return demo(args.reports)


if __name__ == "__main__":
    sys.exit(main())
