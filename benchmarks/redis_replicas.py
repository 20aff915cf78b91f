"""What ``?wait_replicas=1`` costs: claim + finish cycles per second on a Redis store with one
replica, with and without the store waiting (Redis ``WAIT``) for the replica after each write.

Starts a primary and a replica of its own (redis-server on free loopback ports, files in a
temporary folder, appendonly yes / appendfsync always, as a durable store runs) and measures
both sides in the same run, in alternating bursts (the order swapping every round) so that
machine noise hits them alike.

    python benchmarks/redis_replicas.py [--seconds 0.25] [--rounds 16]

Prints cycles/s for each side and the ratio waiting / not waiting.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from benchmarks.store_cycle import alternate, library_cycle

DURABLE = ("--appendonly", "yes", "--appendfsync", "always", "--save", "")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextmanager
def redis_server(folder: Path, *options: str) -> Iterator[int]:
    """A redis-server on a free port; yields the port once it answers."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not on PATH")
    folder.mkdir(parents=True)
    port = _free_port()
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir",
                               str(folder), *DURABLE, *options],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except (redis.ConnectionError, redis.BusyLoadingError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield port
    finally:
        server.terminate()
        server.wait(10)


def _wait_for_replica(port: int) -> None:
    """Until the replica is online (its first full sync done): before, WAIT counts none."""
    client = redis.Redis(port=port, decode_responses=True)
    deadline = time.monotonic() + 10
    while (client.info("replication").get("slave0") or {}).get("state") != "online":
        if time.monotonic() > deadline:
            raise SystemExit("the replica did not attach")
        time.sleep(0.05)


def measure(seconds: float, rounds: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp, \
            redis_server(Path(tmp) / "primary") as primary, \
            redis_server(Path(tmp) / "replica", "--replicaof", "127.0.0.1", str(primary)):
        _wait_for_replica(primary)
        prefix = f"bench_replicas_{uuid.uuid4().hex[:8]}:"
        url = f"redis://127.0.0.1:{primary}/0?prefix={prefix}"
        sides: dict[str, tuple[Callable[[int], None], Callable[[], None]]] = {
            "no wait": library_cycle(url),
            "wait_replicas=1": library_cycle(f"{url}&wait_replicas=1"),
        }
        mean = alternate(sides, seconds, rounds)
    return {**mean, "ratio": mean["wait_replicas=1"] / mean["no wait"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.25, help="per burst and side")
    parser.add_argument("--rounds", type=int, default=16)
    args = parser.parse_args()
    row = measure(args.seconds, args.rounds)
    print(f"{'side':<18}{'cycles/s':>10}")
    for side in ("no wait", "wait_replicas=1"):
        print(f"{side:<18}{row[side]:>10,.0f}")
    print(f"ratio wait/no wait: {row['ratio']:.2f}")


if __name__ == "__main__":
    main()
