"""The core and the example project import no Django: the Django integration is an optional
contrib app (``lease_celery.contrib.django``), imported only by a project that lists it.

(kombu imports ``django.utils.functional`` itself when Django is installed, to serialise
lazy strings; that is counted before lease_celery is imported, and a second check runs with
Django made unimportable.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHECK = """
import sys
{block}
import celery, kombu.utils.json  # what Celery and kombu import of Django themselves
before = {{name for name in sys.modules if name == "django" or name.startswith("django.")}}
import lease_celery, lease_celery.cli, lease_celery.web, lease_celery.stores.registry
import lease_celery.stores.sqlite, lease_celery.stores.postgres
{more}
after = {{name for name in sys.modules if name == "django" or name.startswith("django.")}}
print(",".join(sorted(after - before)))
"""

BLOCK = """
class NoDjango:
    def find_spec(self, name, path=None, target=None):
        if name == "django" or name.startswith("django."):
            raise ImportError(f"{name}: Django is not installed here")
        return None
sys.meta_path.insert(0, NoDjango())
"""


def imported_django(more: str = "", *, block: bool = False) -> str:
    code = CHECK.format(more=more, block=BLOCK if block else "")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_importing_lease_celery_imports_no_django() -> None:
    assert imported_django() == ""


def test_lease_celery_imports_without_django_installed() -> None:
    assert imported_django("lease_celery.open_store('sqlite://').close()", block=True) == ""


def test_the_example_project_imports_no_django() -> None:
    assert imported_django("import example_project.app, example_project.tasks") == ""
