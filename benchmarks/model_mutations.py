"""The mutation check of the model tests: break one rule at a time in a store, and see the
short profile of ``tests/stores/test_model.py`` fail.

The mutations of the writes in the app's transaction (``lock_in``, ``finish_in``,
``record_published_in``) are judged by their own machine (``tests.stores.app_tx_machine``);
each is also run against the store machine, which does not make those calls, to show that
only the new rules catch it.

Each mutation is a text change to one store's SQL or Lua, applied to a copy of the package
and the tests in a temporary directory (the checkout is never touched); the machine then runs
there (``python -m tests.stores.model_machine --profile short``, which imports the copy) and
a mutation is *caught* when it fails. docs/proof.md has the table this prints.

    python -m benchmarks.model_mutations [--only NAME] [--stores sqlite,postgres,redis]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SQLITE, POSTGRES = "lease_celery/stores/sql/sqlite.sql", "lease_celery/stores/sql/postgres.sql"
LUA = "lease_celery/stores/redis/scripts"
APP_TX = "app_tx_machine"
PG_NOW = ("COALESCE(%(now)s::double precision, "
          "extract(epoch FROM clock_timestamp())::double precision)")


@dataclasses.dataclass(frozen=True)
class Mutation:
    """Replace ``old`` by ``new`` in ``path``, at its first occurrence after ``after``."""

    name: str
    store: str
    rule: str
    path: str
    old: str
    new: str
    after: str = ""
    machine: str = "model_machine"  # the module of tests.stores that must catch it

    def apply(self, root: Path) -> None:
        file = root / self.path
        text = file.read_text()
        start = text.index(self.after) if self.after else 0
        at = text.index(self.old, start)
        file.write_text(text[:at] + self.new + text[at + len(self.old):])


MUTATIONS = [
    Mutation("finish-without-expiry", "sqlite", "the finish does not check expires_at > now",
             SQLITE, "\n  AND expires_at > :now", "", "-- name: finish\n"),
    Mutation("token-back-after-purge", "sqlite", "a purge forgets the key's token",
             SQLITE, "WHERE key = :key AND", "WHERE 0 AND", "-- name: retire\n"),
    Mutation("renew-at-deadline", "sqlite", "a renewal is accepted at expires_at == now",
             SQLITE, "expires_at > :now", "expires_at >= :now", "-- name: renew\n"),
    Mutation("no-takeover-at-deadline", "sqlite", "a claim does not take over at "
             "expires_at == now", SQLITE, "(state = 'running' AND expires_at <= :now)",
             "(state = 'running' AND expires_at < :now)", "-- name: claim\n"),
    Mutation("finish-without-expiry", "postgres", "the finish does not check expires_at > now",
             POSTGRES, f"\n  AND l.expires_at > {PG_NOW}", "", "-- name: finish\n"),
    Mutation("token-back-after-purge", "postgres", "a claim of a purged key restarts at 1",
             POSTGRES, "token      = l.token + 1,",
             "token      = CASE WHEN l.state = 'purged' THEN 1 ELSE l.token + 1 END,",
             "-- name: fragment_claim_takes_the_row"),
    Mutation("renew-at-deadline", "postgres", "a renewal is accepted at expires_at == now",
             POSTGRES, "AND l.expires_at > COALESCE", "AND l.expires_at >= COALESCE",
             "-- name: renew_many"),
    Mutation("finish-without-expiry", "redis", "the fenced write does not check "
             "expires_at > now", f"{LUA}/prelude.lua",
             "token == by_token\n          and tonumber(expires_at) > t) then",
             "token == by_token) then"),
    Mutation("token-back-after-purge", "redis", "a purge deletes the key's token counter",
             f"{LUA}/purge.lua", "return redis.call('DEL', KEYS[1])",
             "redis.call('DEL', KEYS[2])\nreturn redis.call('DEL', KEYS[1])"),
    Mutation("renew-at-deadline", "redis", "a renewal is accepted at expires_at == now",
             f"{LUA}/renew.lua", "tonumber(expires_at) > t then", "tonumber(expires_at) >= t then"),
    Mutation("forget-the-epoch", "redis", "scripts do not check the epoch record",
             f"{LUA}/prelude.lua", "if EPOCH_SEEN ~= '' then", "if false then"),
    Mutation("lock-in-without-token", "sqlite", "lock_in does not check the token (an old "
             "lease of the same owner locks in)", SQLITE, " AND token = :token", "",
             "-- name: lock_current\n", machine=APP_TX),
    Mutation("finish-in-answer-ignored", "sqlite", "finish_in answers True when its finish "
             "changed nothing", "lease_celery/stores/sqlite.py", "settle_within)) == 1",
             "settle_within)) >= 0", "def _app_finish", machine=APP_TX),
    Mutation("lock-in-without-expiry", "postgres", "lock_in does not check expires_at > now",
             POSTGRES, "  AND l.expires_at > " + PG_NOW.replace(", ", ",\n" + " " * 30) + "\n", "",
             "-- name: lock_current\n", machine=APP_TX),
    Mutation("outbox-outside-the-transaction", "postgres", "record_published_in commits on "
             "the store's own connection at once", "lease_celery/stores/base.py",
             "return self._app_record_published(conn, key, encoded,",
             "return self._record_published(key, encoded,", machine=APP_TX),
    Mutation("settle-not-idempotent", "redis", "a settled row's own lease is refused",
             f"{LUA}/settle_many.lua", "elseif ours and (state == 'done' or state == 'dead') then",
             "elseif false then"),
]


def run_one(mutation: Mutation | None, store: str, timeout: float,
            machine: str = "model_machine") -> tuple[bool, float, str]:
    """Run the short profile of ``machine`` on ``store`` with ``mutation`` applied; (passed,
    seconds, the first line of the failure)."""
    with tempfile.TemporaryDirectory(prefix="lease-mutant-") as tmp:
        root = Path(tmp)
        for part in ("lease_celery", "tests"):
            shutil.copytree(ROOT / part, root / part,
                            ignore=shutil.ignore_patterns("__pycache__"))
        if mutation is not None:
            mutation.apply(root)
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", f"tests.stores.{machine}", "--profile", "short",
             "--stores", store], cwd=root, capture_output=True, text=True, timeout=timeout,
            env={**os.environ, "PYTHONPATH": str(root), "LEASE_MODEL_SHRINK": "0"})
        took = time.monotonic() - started
        errors = [line for line in done.stderr.splitlines()
                  if line.startswith(("AssertionError", "E ", "    | AssertionError"))
                  or ("Error:" in line and "WARNING" not in line)]
        return done.returncode == 0, took, (errors[-1].strip() if errors else "")[:160]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stores", default="sqlite,postgres,redis")
    parser.add_argument("--only", help="run only the mutations of this name")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    stores = args.stores.split(",")
    machines = {(m.store, m.machine) for m in MUTATIONS
                if m.store in stores and args.only in (None, m.name)}
    for store, machine in sorted(machines):  # the unmutated code must pass, or nothing below
        passed, took, why = run_one(None, store, args.timeout, machine)  # means anything
        print(f"| (none) | {store} | {machine} | {'passes' if passed else 'FAILS: ' + why} | "
              f"{took:.1f} s |", flush=True)
        if not passed:
            raise SystemExit(1)
    missed = 0
    for mutation in MUTATIONS:
        if mutation.store not in stores or args.only not in (None, mutation.name):
            continue
        passed, took, why = run_one(mutation, mutation.store, args.timeout, mutation.machine)
        missed += passed
        verdict = "NOT CAUGHT" if passed else f"caught: {why}"
        if mutation.machine != "model_machine":  # only the new rules make these calls
            alone, _, _ = run_one(mutation, mutation.store, args.timeout)
            verdict += f" (model_machine alone: {'passes' if alone else 'also fails'})"
        print(f"| {mutation.name} | {mutation.store} | {mutation.rule} | {verdict} | "
              f"{took:.1f} s |", flush=True)
    raise SystemExit(1 if missed else 0)


if __name__ == "__main__":
    main()
