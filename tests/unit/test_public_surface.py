"""The public surface is whole: what ``lease_celery`` exports, its version, and the members a
task body sees on ``self.lease``."""

from __future__ import annotations

import importlib.metadata
import inspect
import time

import lease_celery
from lease_celery import LeaseHandle, errors, open_store
from lease_celery.runtime.execution import Execution

#: ``self.lease`` as a task body uses it; everything else on a LeaseHandle is the heartbeat's.
HANDLE_MEMBERS = {
    "key", "token", "owner", "expires_at", "check", "checkpoint", "checkpoint_data", "lost",
    "cancelled",
    # The row's counts for this claim: what the failure policy and the history go by.
    "attempts", "takeovers",
    # Documented in README ("Fencing a resource", "Writes in the lease store's database") and
    # behind ``LeasedTask.effect``: the user's too.
    "fence", "fenced", "effect",
    # docs/transactions.md: the body's rows and the key's finish in one commit of the app's.
    "transaction",
}


def _defined_errors() -> dict[str, type[BaseException]]:
    """Every LeaseError subclass defined in ``lease_celery.errors`` (not imported into it)."""
    return {name: value for name, value in vars(errors).items()
            if inspect.isclass(value) and issubclass(value, errors.LeaseError)
            and value.__module__ == errors.__name__}


def test_every_error_is_importable_from_the_package() -> None:
    """Each exception class of ``lease_celery.errors`` (walked, and as its ``__all__`` names
    it) is ``lease_celery.<Name>`` itself, and in ``lease_celery.__all__``."""
    defined = _defined_errors()
    assert set(errors.__all__) == set(defined)  # errors.__all__ itself is whole
    missing = sorted(name for name in defined
                     if getattr(lease_celery, name, None) is not defined[name])
    assert missing == [], f"not importable from lease_celery: {missing}"
    unlisted = sorted(set(defined) - set(lease_celery.__all__))
    assert unlisted == [], f"not in lease_celery.__all__: {unlisted}"


def test_the_names_in_all_exist() -> None:
    """``from lease_celery import *`` gets every name ``__all__`` lists."""
    absent = [name for name in lease_celery.__all__ if not hasattr(lease_celery, name)]
    assert absent == []
    assert len(set(lease_celery.__all__)) == len(lease_celery.__all__)


def test_version_is_the_distributions() -> None:
    """``lease_celery.__version__`` is the installed distribution's version (from its metadata,
    so it cannot drift from pyproject.toml)."""
    assert lease_celery.__version__ == importlib.metadata.version("lease-celery")


def test_the_lease_handle_shows_a_body_only_what_is_its_own() -> None:
    """The public members of ``LeaseHandle`` are exactly what a task body uses, each with a
    docstring; ``lost`` and ``cancelled`` are the same kind of member (read-only properties:
    None while the lease holds, else a sentence saying what happened)."""
    public = {name for name in dir(LeaseHandle) if not name.startswith("_")}
    assert public == HANDLE_MEMBERS
    with open_store("sqlite://") as store:  # and nothing more on an instance (its __dict__)
        lease = store.claim("surface:1", owner="me", ttl=30)
        assert lease is not None
        handle = Execution(lease, store=store, ttl=30, heartbeat_interval=10,
                           sent_at=time.monotonic()).view
        assert {name for name in dir(handle) if not name.startswith("_")} == HANDLE_MEMBERS
        assert (handle.lost, handle.cancelled) == (None, None)
    undocumented = sorted(name for name in public
                          if not (inspect.getdoc(getattr(LeaseHandle, name)) or "").strip())
    assert undocumented == []
    for name in ("lost", "cancelled"):
        member = inspect.getattr_static(LeaseHandle, name)
        assert isinstance(member, property) and member.fset is None, name


def test_the_package_metadata_is_ready_for_an_index() -> None:
    """The installed distribution's metadata: the SPDX license with its file, the Celery
    framework classifier, this interpreter's version among those claimed (the suite runs on
    it), keywords, the users' extras only; the changelog has a section for
    ``__version__``."""
    import sys
    from importlib import metadata
    from pathlib import Path

    import lease_celery

    repo = Path(__file__).resolve().parents[2]
    found = metadata.metadata("lease-celery")
    assert found["License-Expression"] == "MIT"
    assert found.get_all("License-File") == ["LICENSE"] and (repo / "LICENSE").is_file()
    classifiers = found.get_all("Classifier") or []
    assert "Framework :: Celery" in classifiers
    running = f"Programming Language :: Python :: {sys.version_info[0]}.{sys.version_info[1]}"
    assert running in classifiers, classifiers
    assert "celery" in (found["Keywords"] or "").split(",")
    # The contributors' tools are dependency groups, not extras users could install.
    assert set(found.get_all("Provides-Extra") or []) == {
        "postgres", "redis", "mysql", "sqs", "prometheus", "otel", "web", "django"}
    changelog = (repo / "CHANGELOG.md").read_text()
    assert f"## {lease_celery.__version__} " in changelog


def test_an_installed_package_that_cannot_load_says_what_to_do_instead() -> None:
    """``extras.needs``: a package missing names the extra's install command; one installed
    that fails to load (psycopg without a libpq) says what its ``if_broken`` says instead."""
    import pytest

    from lease_celery.extras import needs

    broken = "psycopg is installed but loads no libpq: install libpq5"
    loading = needs("the store", "psycopg", extra="postgres", if_broken=broken)
    with pytest.raises(ImportError, match=r"\(no pq wrapper available\): psycopg is installed "
                                          r"but loads no libpq") as caught, loading:
        raise ImportError("no pq wrapper available")
    assert not isinstance(caught.value, ModuleNotFoundError)
    missing = needs("the store", "psycopg", extra="postgres", if_broken=broken)
    with pytest.raises(ModuleNotFoundError,
                       match=r"pip install 'lease-celery\[postgres\]'"), missing:
        raise ModuleNotFoundError("No module named 'psycopg'", name="psycopg")
