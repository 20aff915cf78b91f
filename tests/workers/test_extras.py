"""Each extra gives a working broker and store on a fresh venv: what ``pip install
'lease-celery[<extra>]'`` gets a user, with nothing from the development venv.

The repository's files are copied out (no build artefacts, no .venv) and built into an sdist
and a wheel once (``python -m build``, as a release would); each test makes a venv of its own
in tmp (``python -m venv --without-pip``, no system site-packages), installs
``<wheel>[<extra>]`` into it with pip (``pip --python``: the venv's own pip would install the
same thing, only slower), and then runs the venv's own python, with no inherited
``PYTHON*`` variables and a working directory outside the repository:

- ``redis``: a real ``celery worker`` (prefork) on a Redis broker and result backend, with a
  Redis lease store; the venv's client sends a LeasedTask and gets its result.
- ``postgres``: the venv's client claims and finishes a lease on a PostgreSQL store directly,
  then a real worker on RabbitMQ (``amqp://``, which needs no extra) with ``rpc://`` results
  runs a LeasedTask on that store.
- ``prometheus``: a real worker (filesystem broker, SQLite store) serves its metrics
  (``lease_metrics_port``, multiprocess mode); the client scrapes the task's claim counter.

Each venv first proves it is isolated: lease_celery is imported from the venv, and the other
extras' packages and pytest are not importable.

And the other side, without a venv of its own: an install *without* an extra. A fresh
interpreter in which the extra's packages cannot be imported (a ``sys.meta_path`` finder that
says they are not there) imports every module of lease_celery that needs none, and each
module or store that needs an extra raises an ImportError that names
``pip install 'lease-celery[<extra>]'``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lease_celery import LeaseState, open_store
from tests.support.policy_helpers import free_port
from tests.support.rabbitmq import private_vhost
from tests.support.servers import REDIS_URL
from tests.support.tokens import token_base

REPO = Path(__file__).resolve().parents[2]
#: What a user's sdist would not carry either; copied trees stay small and clean.
_NOT_SOURCE = shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info",
                                     "__pycache__", ".*_cache", "*.sqlite3*", "example-data")
PIP_TIMEOUT = 150

#: The Celery app the fresh venvs run, configured from the environment.
APP = '''
import os

from celery import Celery

import lease_celery
from lease_celery import LeasedTask

app = Celery("extras_app", broker=os.environ["EXTRAS_BROKER"],
             backend=os.environ["EXTRAS_BACKEND"])
app.conf.update(
    task_default_queue=os.environ["EXTRAS_QUEUE"],
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    lease_store_url=os.environ["EXTRAS_STORE"],
    lease_ttl=10,
)
if os.environ.get("EXTRAS_DATA"):
    folder = os.path.join(os.environ["EXTRAS_DATA"], "broker")
    app.conf.broker_transport_options = {"data_folder_in": folder, "data_folder_out": folder,
                                         "polling_interval": 0.1}
if os.environ.get("EXTRAS_METRICS_PORT"):
    app.conf.lease_metrics_port = int(os.environ["EXTRAS_METRICS_PORT"])


@app.task(base=LeasedTask, bind=True, lease_key="extras:{n}")
def double(self, n):
    return {"n": 2 * n, "token": self.lease.token, "lease_celery": lease_celery.__file__}
'''

#: The venv's client: isolation checks, the extra's own step, then one task through a worker.
CLIENT = '''
import importlib.util
import json
import os
import sys
import urllib.request

import lease_celery

venv = os.environ["EXTRAS_VENV"]
assert sys.prefix == venv and lease_celery.__file__.startswith(venv), (sys.prefix,
                                                                       lease_celery.__file__)
for name in os.environ["EXTRAS_ABSENT"].split():
    assert importlib.util.find_spec(name) is None, f"{name} is importable in the fresh venv"
out = {}
if os.environ.get("EXTRAS_DIRECT"):
    store = lease_celery.open_store(os.environ["EXTRAS_STORE"])
    lease = store.claim("direct:1", owner="fresh-venv", ttl=30)
    out["direct"] = [lease.token, store.finish(lease, {"ok": True}),
                     store.get("direct:1").state.value]
    store.close()

from extras_app import double

out["result"] = double.delay(21).get(timeout=60)
if os.environ.get("EXTRAS_METRICS_PORT"):
    url = f"http://127.0.0.1:{os.environ['EXTRAS_METRICS_PORT']}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out["metrics"] = [line for line in text.splitlines() if line.startswith("lease_celery_")]
print("EXTRAS:" + json.dumps(out))
'''


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """lease-celery's sdist and wheel, as a release builds them from a copy of the
    repository's files: ``python -m build`` makes the sdist, then the wheel from the sdist
    alone (so a file the sdist lacks breaks the wheel)."""
    base = tmp_path_factory.mktemp("extras-build")
    shutil.copytree(REPO, base / "src", ignore=_NOT_SOURCE)
    done = subprocess.run([sys.executable, "-m", "build", "-o", str(base / "dist"),
                           str(base / "src")],
                          capture_output=True, text=True, timeout=PIP_TIMEOUT, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    (sdist,) = (base / "dist").glob("lease_celery-*.tar.gz")
    (built,) = (base / "dist").glob("lease_celery-*.whl")
    return sdist, built


@pytest.fixture(scope="module")
def wheel(dists: tuple[Path, Path]) -> Path:
    return dists[1]


def test_the_sdist_holds_the_library_and_what_a_release_needs(
        dists: tuple[Path, Path]) -> None:
    """The sdist an index would get: the package with its data, the README, LICENSE,
    CHANGELOG and pyproject.toml, and nothing of the checkout beyond (no tests, example
    project, docs, caches or databases); ``twine check`` passes."""
    sdist = dists[0]
    with tarfile.open(sdist) as archive:
        names = [name.split("/", 1)[1] for name in archive.getnames() if "/" in name]
    tops = {name.split("/", 1)[0] for name in names}
    assert tops == {"lease_celery", "lease_celery.egg-info", "LICENSE", "README.md",
                    "CHANGELOG.md", "pyproject.toml", "PKG-INFO", "setup.cfg",
                    "MANIFEST.in"}, tops
    for data in ("lease_celery/py.typed", "lease_celery/stores/sql/postgres.sql",
                 "lease_celery/stores/redis/scripts/prelude.lua",
                 "lease_celery/web/static/dashboard.css", "lease_celery/task.py"):
        assert data in names, data
    assert not [name for name in names if "__pycache__" in name or ".sqlite3" in name]
    checked = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(sdist)],
                             capture_output=True, text=True, timeout=60, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_wheel_holds_the_library_its_data_and_its_entry_points(wheel: Path) -> None:
    """The wheel an index would get: only ``lease_celery`` (no ``example_project``, no tests),
    with its SQL, Lua, CSS and ``py.typed``; the license file; the ``celery leases`` command
    and the pytest plugin as entry points; the users' extras only; ``twine check`` passes."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(info).decode()
        entry_points = archive.read(info.replace("METADATA", "entry_points.txt")).decode()
    tops = {name.split("/", 1)[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"lease_celery"}, tops
    for data in ("lease_celery/py.typed", "lease_celery/stores/sql/sqlite.sql",
                 "lease_celery/stores/sql/postgres.sql",
                 "lease_celery/stores/redis/scripts/claim_limited.lua",
                 "lease_celery/web/static/dashboard.css",
                 "lease_celery/contrib/django/templates/admin/lease_celery/pagination.html",
                 "lease_celery/contrib/django/migrations/0001_initial.py"):
        assert data in names, data
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names), names
    assert "leases = lease_celery.cli:leases" in entry_points
    assert "lease_celery = lease_celery.pytest_plugin" in entry_points
    extras = {line.split(": ", 1)[1] for line in metadata.splitlines()
              if line.startswith("Provides-Extra: ")}
    assert extras == {"postgres", "redis", "sqs", "prometheus", "otel", "web", "django",
                      "mysql"}
    assert "License-Expression: MIT" in metadata
    checked = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(wheel)],
                             capture_output=True, text=True, timeout=60, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def fresh_venv(tmp_path: Path, wheel: Path, extra: str) -> Path:
    """A new venv in ``tmp_path`` with ``lease-celery[extra]`` installed from ``wheel``."""
    venv = tmp_path / f"venv-{extra}"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=60)
    python = venv / "bin" / "python"
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                           "-q", f"{wheel}[{extra}]"],
                          capture_output=True, text=True, timeout=PIP_TIMEOUT, check=False,
                          env=_clean_env())
    assert done.returncode == 0, done.stdout + done.stderr
    return venv


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment without anything that points Python at the development venv."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYTHON") and k not in ("VIRTUAL_ENV", "CELERY_CONFIG_MODULE")}
    return {**env, "PYTHONNOUSERSITE": "1", **extra}


class Scene:
    """The app and client files of one venv, and the worker that runs them."""

    def __init__(self, tmp_path: Path, venv: Path, env: dict[str, str]) -> None:
        self.dir = tmp_path / "app"
        self.dir.mkdir()
        (self.dir / "extras_app.py").write_text(textwrap.dedent(APP))
        (self.dir / "client.py").write_text(textwrap.dedent(CLIENT))
        self.python = str(venv / "bin" / "python")
        self.env = _clean_env(PYTHONPATH=str(self.dir), EXTRAS_VENV=str(venv),
                              EXTRAS_QUEUE=f"extras-{uuid.uuid4().hex[:8]}", **env)
        self.log = tmp_path / "worker.log"
        self.worker: subprocess.Popen[bytes] | None = None

    def start_worker(self) -> None:
        with self.log.open("wb") as out:
            self.worker = subprocess.Popen(
                [self.python, "-m", "celery", "-A", "extras_app", "worker", "-P", "prefork",
                 "-c", "1", "-Q", self.env["EXTRAS_QUEUE"], "--without-gossip",
                 "--without-mingle", "--without-heartbeat", "-l", "info"],
                cwd=self.dir, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)

    def run_client(self) -> dict[str, Any]:
        done = subprocess.run([self.python, "client.py"], cwd=self.dir, env=self.env,
                              capture_output=True, text=True, timeout=90, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("EXTRAS:")]
        assert done.returncode == 0 and lines, (
            f"client failed ({done.returncode}):\n{done.stdout}{done.stderr}\n"
            f"----- worker -----\n{self.worker_output()}")
        result: dict[str, Any] = json.loads(lines[-1].removeprefix("EXTRAS:"))
        return result

    def worker_output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        if self.worker is not None and self.worker.poll() is None:
            self.worker.terminate()  # the main process: a warm shutdown
            try:
                self.worker.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.worker.pid, signal.SIGKILL)
                self.worker.wait(10)


@pytest.fixture
def scene() -> Iterator[list[Scene]]:
    made: list[Scene] = []
    yield made
    for each in made:
        each.stop()


def _check_task(result: dict[str, Any], venv: Path, store_url: str) -> None:
    """The worker ran the task from the venv's lease_celery, under the key's first token
    (base + 1), and the store recorded that result as done."""
    with open_store(store_url) as store:
        record = store.get("extras:21")
        base = token_base(store)
    assert result["n"] == 42 and result["token"] == base + 1
    assert result["lease_celery"].startswith(str(venv))
    assert record is not None and (record.state, record.token) == (LeaseState.DONE, base + 1)
    assert record.result == result


@pytest.mark.worker
def test_redis_extra_runs_a_redis_broker_and_store(
        tmp_path: Path, wheel: Path, redis_client: Any, redis_store_url: str,
        scene: list[Scene]) -> None:
    """``lease-celery[redis]`` on a fresh venv: kombu's Redis transport imports (it needs
    ``packaging``, which the extra must bring), redis-py finds its C parser (hiredis), a
    worker consumes from a Redis broker, stores its result in Redis and its lease in a Redis
    store."""
    venv = fresh_venv(tmp_path, wheel, "redis")
    parser = subprocess.run([str(venv / "bin" / "python"), "-c",
                             "import redis.utils; print(redis.utils.HIREDIS_AVAILABLE)"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert parser.stdout.strip() == "True", parser.stdout + parser.stderr
    helped = subprocess.run([str(venv / "bin" / "celery"), "leases", "--help"],
                            capture_output=True, text=True, timeout=60, check=False,
                            env=_clean_env())
    assert helped.returncode == 0 and "limits" in helped.stdout, helped.stdout + helped.stderr
    one = Scene(tmp_path, venv, {"EXTRAS_BROKER": REDIS_URL, "EXTRAS_BACKEND": REDIS_URL,
                                 "EXTRAS_STORE": redis_store_url,
                                 "EXTRAS_ABSENT": "pytest psycopg prometheus_client"})
    scene.append(one)
    one.start_worker()
    out = one.run_client()
    _check_task(out["result"], venv, redis_store_url)


@pytest.mark.worker
def test_postgres_extra_opens_a_postgres_store_for_a_rabbitmq_worker(
        tmp_path: Path, wheel: Path, postgres_url: str, scene: list[Scene]) -> None:
    """``lease-celery[postgres]`` on a fresh venv: a direct claim and finish on PostgreSQL,
    then a worker on RabbitMQ (py-amqp comes with kombu) with ``rpc://`` results runs a
    LeasedTask on that store. Neither redis-py nor ``packaging`` is needed for that."""
    with private_vhost("lease_test_extras") as broker:
        venv = fresh_venv(tmp_path, wheel, "postgres")
        one = Scene(tmp_path, venv, {"EXTRAS_BROKER": broker, "EXTRAS_BACKEND": "rpc://",
                                     "EXTRAS_STORE": postgres_url, "EXTRAS_DIRECT": "1",
                                     "EXTRAS_ABSENT": "pytest redis prometheus_client"})
        scene.append(one)
        one.start_worker()
        out = one.run_client()
        one.stop()
    assert out["direct"] == [1, True, "done"]
    _check_task(out["result"], venv, postgres_url)


@pytest.mark.worker
def test_prometheus_extra_serves_worker_metrics(
        tmp_path: Path, wheel: Path, sqlite_url: str, scene: list[Scene]) -> None:
    """``lease-celery[prometheus]`` on a fresh venv: a prefork worker (filesystem broker,
    SQLite store) with ``lease_metrics_port`` and ``PROMETHEUS_MULTIPROC_DIR`` serves the pool
    process's claim counter for the task it ran."""
    venv = fresh_venv(tmp_path, wheel, "prometheus")
    (tmp_path / "prom").mkdir()
    port = free_port()
    one = Scene(tmp_path, venv, {"EXTRAS_BROKER": "filesystem://",
                                 "EXTRAS_BACKEND": f"file://{tmp_path / 'results'}",
                                 "EXTRAS_DATA": str(tmp_path), "EXTRAS_STORE": sqlite_url,
                                 "EXTRAS_METRICS_PORT": str(port),
                                 "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom"),
                                 "EXTRAS_ABSENT": "pytest redis psycopg"})
    (tmp_path / "broker").mkdir()
    (tmp_path / "results").mkdir()
    scene.append(one)
    one.start_worker()
    deadline = time.monotonic() + 30
    while "lease metrics served" not in one.worker_output():  # the server is up before a task
        assert time.monotonic() < deadline, one.worker_output()
        time.sleep(0.1)
    out = one.run_client()
    _check_task(out["result"], venv, sqlite_url)
    assert 'lease_celery_claims_total{task="extras_app.double"} 1.0' in out["metrics"], \
        out["metrics"]


# -- without the extra -------------------------------------------------------------------------

#: Every package lease_celery imports that its ``[project] dependencies`` do not bring: the
#: extras' (``otel``, ``prometheus``, ``postgres``, ``redis``), and what only the third-party
#: beat schedulers and the green pools import (they are never lease_celery's to install).
OPTIONAL = ("opentelemetry", "prometheus_client", "psycopg", "redis", "hiredis",
            "redbeat", "django", "django_celery_beat", "gevent", "eventlet")

#: The modules that need an extra to import at all, and that extra.
NEEDS_EXTRA = {
    "lease_celery.otel": "otel",
    "lease_celery.stores.postgres": "postgres",
    "lease_celery.stores.pg_connections": "postgres",
    "lease_celery.stores.redis": "redis",
    "lease_celery.stores.redis.wire": "redis",
    # The Django app: every module of it (its package imports Django, naming the extra).
    **{f"lease_celery.contrib.django{name}": "django" for name in (
        "", ".actions", ".admin", ".apps", ".config", ".models", ".paginator", ".postgres",
        ".schema", ".sqlite", ".store", ".task", ".transactions", ".migrations",
        ".migrations.0001_initial")},
}

#: Runs in a fresh interpreter: the packages named in ``EXTRAS_BLOCK`` cannot be imported
#: (``find_spec`` says so, as on an install without them), then ``EXTRAS_STEP`` runs and what it
#: raised is printed.
WITHOUT = '''
import importlib.abc
import json
import os
import sys

blocked = set(os.environ["EXTRAS_BLOCK"].split())
assert not blocked & {name.partition(".")[0] for name in sys.modules}, "imported at start-up"


class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())


def raised(step):
    try:
        step()
    except BaseException as exc:
        return {"type": type(exc).__name__, "import_error": isinstance(exc, ImportError),
                "message": str(exc)}
    return None


out = {}
exec(os.environ["EXTRAS_STEP"])
print("EXTRAS:" + json.dumps(out))
'''


def without(blocked: str, step: str) -> dict[str, Any]:
    """Run ``step`` (which fills ``out``) in a fresh interpreter where ``blocked`` (package
    names) cannot be imported; return ``out``."""
    done = subprocess.run([sys.executable, "-c", WITHOUT], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False,
                          env={**os.environ, "EXTRAS_BLOCK": blocked,
                               "EXTRAS_STEP": textwrap.dedent(step)})
    lines = [line for line in done.stdout.splitlines() if line.startswith("EXTRAS:")]
    assert done.returncode == 0 and lines, done.stdout + done.stderr
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("EXTRAS:"))
    return result


def test_every_module_that_needs_no_extra_imports_without_any() -> None:
    """With none of the optional packages importable, ``import lease_celery`` and every one of
    its modules imports, except those that need an extra (``NEEDS_EXTRA``): a module that
    imported an optional package at its top would show up here."""
    out = without(" ".join(OPTIONAL), """
        import importlib
        import pkgutil

        import lease_celery

        for info in pkgutil.walk_packages(lease_celery.__path__, "lease_celery."):
            if not info.name.endswith("__main__"):  # runs the CLI
                out[info.name] = raised(lambda: importlib.import_module(info.name))
        """)
    assert "lease_celery.cli" in out and "lease_celery.web.app" in out  # the walk went deep
    failed = {name: error for name, error in out.items() if error is not None}
    assert set(failed) <= set(NEEDS_EXTRA), failed


@pytest.mark.parametrize(("extra", "blocked", "step"), [
    pytest.param("otel", "opentelemetry", "import lease_celery.otel", id="otel"),
    pytest.param("prometheus", "prometheus_client",
                 "from lease_celery.metrics import serve; serve(0)", id="prometheus-serve"),
    pytest.param("postgres", "psycopg",
                 "import lease_celery; lease_celery.open_store('postgresql://127.0.0.1:1/none')",
                 id="postgres-store"),
    pytest.param("redis", "redis hiredis",
                 "import lease_celery; lease_celery.open_store('redis://127.0.0.1:1/0')",
                 id="redis-store"),
    pytest.param("django", "django",
                 "import lease_celery; lease_celery.open_store('django://default')",
                 id="django-store"),
])
def test_a_missing_extra_is_an_import_error_naming_it(extra: str, blocked: str,
                                                       step: str) -> None:
    """Without the extra's packages, using what needs them raises an ImportError whose message
    names ``pip install 'lease-celery[<extra>]'`` (and the package that was not found)."""
    out = without(blocked, f"out['error'] = raised(lambda: exec({step!r}))")
    error = out["error"]
    assert error is not None, f"{step!r} raised nothing without {blocked}"
    assert error["import_error"], error
    assert f"pip install 'lease-celery[{extra}]'" in error["message"], error
    assert any(f"No module named '{name}'" in error["message"] for name in blocked.split()), error


def test_a_missing_beat_scheduler_package_names_its_install() -> None:
    """The third-party schedulers are not extras: their ImportError names the package's own
    ``pip install`` (the same helper builds it)."""
    out = without("redbeat", """
        out['error'] = raised(
            lambda: __import__('lease_celery.beat').beat.LeasedRedBeatScheduler)
        """)
    error = out["error"]
    assert error is not None and error["import_error"], error
    assert "pip install celery-redbeat" in error["message"], error
    assert "No module named 'redbeat'" in error["message"], error


def test_the_tools_name_a_missing_extra_in_one_line(tmp_path: Path) -> None:
    """Without psycopg, ``leases --store postgresql://… list`` says in one line (no traceback,
    exit 1) what to install, and ``doctor`` reports the app's PostgreSQL store as a finding
    naming the extra."""
    out = without("psycopg", f"""
        import contextlib, io, sys
        from celery import Celery
        from lease_celery.cli import leases
        from lease_celery.doctor import diagnose

        app = Celery("noextra", broker="memory://", set_as_current=False)
        app.conf.lease_store_url = "sqlite:///{tmp_path}/l.sqlite3"
        err = io.StringIO()

        class Named:
            load_error = None

        Named.app = app
        with contextlib.redirect_stderr(err):
            try:
                leases.main(["--store", "postgresql://127.0.0.1:1/none", "list"], obj=Named,
                            standalone_mode=True)
            except SystemExit as exc:
                out["code"] = exc.code
        out["stderr"] = err.getvalue()
        app.conf.lease_store_url = "postgresql://127.0.0.1:1/none"
        out["findings"] = [f.as_dict() for f in diagnose(app) if f.severity == "error"]
        """)
    assert out["code"] == 1, out
    assert len(out["stderr"].strip().splitlines()) == 1, out["stderr"]
    assert "pip install 'lease-celery[postgres]'" in out["stderr"]
    assert "Traceback" not in out["stderr"]
    messages = " ".join(f["message"] for f in out["findings"])
    assert "lease_store_url" in messages and "pip install 'lease-celery[postgres]'" in messages
    # The URL is fine: the fix is the extra, not another URL.
    assert [f["code"] for f in out["findings"]] == ["store.extra_missing"], out["findings"]
    assert "set lease_store_url to" not in messages, messages


#: Runs ``celery`` (its arguments after ``--``) in an interpreter where psycopg cannot be
#: imported, as on an install without the postgres extra.
CELERY_WITHOUT_PSYCOPG = WITHOUT.split("\n\ndef raised")[0] + """
from celery.__main__ import main
sys.argv = ["celery", *sys.argv[1:]]
main()
"""

#: An app whose store is PostgreSQL, for a host without the postgres extra.
POSTGRES_APP = """
from celery import Celery
from lease_celery import LeasedTask
app = Celery("pgapp", broker="memory://", set_as_current=False)
app.conf.update(lease_store_url="postgresql://127.0.0.1:1/none", task_acks_late=True,
                task_reject_on_worker_lost=True)
@app.task(base=LeasedTask, bind=True, lease_key="job:{n}")
def job(self, n):
    return n
"""


def test_a_worker_and_a_publisher_without_the_extra_say_so_in_one_line(tmp_path: Path) -> None:
    """Without psycopg, a ``celery worker`` whose app's store is PostgreSQL exits non-zero
    with one line naming ``pip install 'lease-celery[postgres]'`` and no traceback; a
    publisher that does not use the store (no lease_record_at_publish, no lease_unique)
    publishes with ``.delay()`` as it would without lease_celery."""
    (tmp_path / "pgapp.py").write_text(POSTGRES_APP)
    env = {**os.environ, "EXTRAS_BLOCK": "psycopg", "PYTHONPATH": str(tmp_path)}
    worker = subprocess.run(
        [sys.executable, "-c", CELERY_WITHOUT_PSYCOPG, "-A", "pgapp", "worker", "-P", "solo",
         "--without-mingle", "--without-gossip"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False)
    output = worker.stdout + worker.stderr
    assert worker.returncode != 0, output
    assert "Traceback" not in output, output
    said = [line for line in output.splitlines() if "lease-celery[postgres]" in line]
    assert len(said) == 1 and "pip install 'lease-celery[postgres]'" in said[0], output
    published = subprocess.run(
        [sys.executable, "-c", WITHOUT.split("\n\ndef raised")[0]
         + "\nimport pgapp\nprint('sent', pgapp.job.delay(1).id is not None)\n"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert published.returncode == 0, published.stdout + published.stderr
    assert published.stdout.strip() == "sent True", published.stdout


def test_the_dashboard_beyond_loopback_without_waitress_names_the_web_extra() -> None:
    """Without waitress, ``web --host 0.0.0.0`` is refused with one message naming
    ``pip install 'lease-celery[web]'``: the stdlib's server would hold a thread per open
    connection, on a network."""
    out = without("waitress", """
        from lease_celery.web.serve import serve
        out['error'] = raised(lambda: serve('sqlite://', host='0.0.0.0', port=0,
                                            token='x' * 16, announce=lambda line: None))
        """)
    error = out["error"]
    assert error is not None and not error["import_error"], error
    assert "pip install 'lease-celery[web]'" in error["message"], error
