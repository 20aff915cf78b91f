"""The package's modules import each other without a circle, lazy imports inside functions
included (those hid the circles sweeper → task → worker → sweeper and timelimits → task);
imports under ``TYPE_CHECKING`` do not run, so they do not count. Nothing is wired by an
import: ``lease_celery.install()`` connects the receivers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lease_celery"


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _typing_only(tree: ast.Module) -> set[int]:
    """The nodes under ``if TYPE_CHECKING:``."""
    nodes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            nodes.update(id(inner) for part in node.body for inner in ast.walk(part))
    return nodes


def import_graph(*, typing_too: bool = False) -> dict[str, set[str]]:
    """module -> the package's modules it imports when it runs (at its top or in a function);
    ``typing_too``: and under ``TYPE_CHECKING``, as a tool that reads every import statement
    without running the code sees them."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        skip = set() if typing_too else _typing_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                submodules = [f"{origin}.{a.name}" for a in node.names
                              if f"{origin}.{a.name}" in modules]
                targets = submodules + ([origin] if len(submodules) < len(node.names) else [])
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_lazy_imports() -> None:
    """The reader finds imports inside functions (doctor imports celery's helpers there) and
    relative ones from sub-packages (the stores' ``..checks``)."""
    graph = import_graph()
    assert "lease_celery.checks" in graph["lease_celery.stores.sqlite"]
    assert "lease_celery.web.serve" in graph["lease_celery.cli"]  # imported inside `web`


def test_no_import_circles() -> None:
    """No group of lease_celery's modules imports itself round."""
    assert circles(import_graph()) == []


def test_no_import_circles_even_counting_typing_only_imports() -> None:
    """An import-graph tool that reads every import statement (lazy ones inside functions and
    those under ``TYPE_CHECKING`` alike) finds no circle either: the store contract builds
    ``Effects``, which types its store by a protocol of its own (``effects.ReceiptStore``)
    instead of importing the contract back; an execution makes its handle, which types its
    owner by ``runtime.handle.Owner``."""
    graph = import_graph(typing_too=True)
    assert "lease_celery.effects" in graph["lease_celery.stores.base"]  # at the top, not lazy
    assert circles(graph) == []


def test_importing_connects_nothing_install_does() -> None:
    """A fresh ``import lease_celery`` leaves Celery's and lease_celery's signals without a
    receiver of ours; ``install()`` connects them, once however often it is called."""
    script = """
import lease_celery
from celery import signals as celery_signals
from lease_celery import signals

def ours():
    found = []
    for signal in [*(getattr(celery_signals, n) for n in ('worker_init', 'task_postrun',
                                                          'task_failure', 'worker_ready')),
                   *(getattr(signals, n) for n in ('lease_acquired', 'lease_lost'))]:
        found += [key for key, _ in signal.receivers
                  if str(key[0]).startswith('lease_celery.')]
    return len(found)

before = ours()
lease_celery.install()
once = ours()
lease_celery.install()
print(before, once, ours())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr
    before, once, twice = map(int, done.stdout.split())
    assert before == 0 and once > 0 and twice == once, done.stdout


#: The layers, lowest first: a module imports only from its own layer and those below it.
#: CONTRIBUTING.md draws the same picture; a new module has to be placed here.
LAYERS: list[tuple[str, set[str]]] = [
    ("basic types", {"errors", "models", "checks", "extras", "identity", "signals", "policy",
                     "keys", "fencing", "apps", "limits", "app_connections"}),
    ("stores", {"stores", "stores.base", "stores.rows", "stores.urls", "stores.registry",
                "stores.queries", "stores.sql_glue", "stores.sqlite", "stores.postgres",
                "stores.pg_connections", "stores.connection_list", "stores.server_store",
                "stores.sqlite_diagnosis", "stores.redis.diagnosis",
                "stores.redis", "stores.redis.store", "stores.redis.lua",
                "stores.redis.options", "stores.redis.wire", "effects",
                "stores.mysql", "stores.mysql_connections", "stores.mysql_diagnosis",
                "stores.mysql_limits", "stores.mysql_schema",
                # the contract's reference model: basic types only; tests and benchmarks
                # import it, nothing in the package does
                "stores.model"}),
    ("settings", {"catalog", "settings", "names"}),
    ("per-process runtime", {"runtime", "runtime.handle", "runtime.heartbeat", "runtime.green",
                             "runtime.history", "runtime.claims", "runtime.execution",
                             "runtime.senders", "runtime.writes_behind",
                             "runtime.confirmations"}),
    ("the task's path", {"task", "execution", "execution.ending", "execution.gate",
                         "execution.background", "execution.settle", "execution.answers",
                         "execution.unique",
                         "execution.delivery", "execution.outage", "execution.published",
                         "execution.recovery", "execution.limited", "execution.outcome",
                         "execution.completion", "execution.replaced",
                         "execution.transactional", "execution.outbox"}),
    ("worker and beat", {"worker", "worker.sweeper", "worker.timelimits", "worker.lifecycle",
                         "worker.visibility",
                         "beat", "slots", "wiring", "metrics", "doctor"}),
    ("edges", {"", "__main__", "cli", "ops", "otel", "testing", "pytest_plugin", "web",
               "web.app",
               "web.pages", "web.html", "web.timeline", "web.serve"}),
    # Optional integrations, imported by no module below (the registry names the django://
    # store by its path): what a Django project lists in INSTALLED_APPS.
    ("integrations", {"contrib", "contrib.django", "contrib.django.apps",
                      "contrib.django.config", "contrib.django.schema",
                      "contrib.django.store", "contrib.django.postgres",
                      "contrib.django.sqlite", "contrib.django.mysql",
                      "contrib.django.models",
                      "contrib.django.paginator", "contrib.django.actions",
                      "contrib.django.admin", "contrib.django.task",
                      "contrib.django.transactions",
                      "contrib.django.migrations", "contrib.django.migrations.0001_initial",
                      "contrib.django.migrations.0002_receipts_state_index"}),
]

#: The one import that points up, and why: LeasedTask is the only hook lease_celery has into
#: a user's app, so binding the task is where install() (the composition root) gets called.
UPWARD = {("task", "wiring")}


def _short(module: str) -> str:
    return module.removeprefix("lease_celery").removeprefix(".")


def test_every_module_has_a_layer_and_imports_only_downwards() -> None:
    layer_of = {name: rank for rank, (_, names) in enumerate(LAYERS) for name in names}
    graph = {_short(module): {_short(t) for t in targets}
             for module, targets in import_graph().items()}
    assert set(graph) - set(layer_of) == set(), "place the new modules in LAYERS"
    upward = {(module, target) for module, targets in graph.items() for target in targets
              if layer_of[target] > layer_of[module]}
    assert upward == UPWARD, {f"{m} ({LAYERS[layer_of[m]][0]}) -> {t} ({LAYERS[layer_of[t]][0]})"
                              for m, t in upward - UPWARD}
