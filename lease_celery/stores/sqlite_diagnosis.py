"""What the SQLite store says about itself (``SQLiteStore.diagnose``): where its file lives.

A SQLite store holds its promises only for the processes that share its file on one local
disk: in memory each process has leases of its own, a relative path is each worker's working
directory, and on a network file system SQLite's locks are not reliable.
"""

from __future__ import annotations

import os

from ..models import Finding

__all__ = ["NETWORK_FILESYSTEMS", "filesystem_type", "path_findings"]

#: File systems whose locks SQLite cannot rely on (and that several hosts may share).
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "ceph", "glusterfs", "lustre", "fuse.sshfs",
    "fuse.glusterfs", "afs", "beegfs", "gpfs"})


def path_findings(path: str) -> list[Finding]:
    """The findings about a SQLite store at ``path`` as its URL gives it (``:memory:`` or
    empty: in memory)."""
    if not path or path == ":memory:":
        return [Finding("store.sqlite_memory", "error", "ownership",
                        "sqlite:// is in memory: each worker process has its own leases")]
    found: list[Finding] = []
    if not os.path.isabs(path):
        found.append(Finding(
            "store.sqlite_relative", "warning", "ownership",
            f"the SQLite store path {path!r} is relative: workers started in other directories "
            "keep other leases. Use sqlite:////absolute/path"))
    fstype = filesystem_type(os.path.abspath(path))
    if fstype in NETWORK_FILESYSTEMS:
        found.append(Finding(
            "store.sqlite_network_fs", "error", "ownership",
            f"the SQLite store {path!r} is on a network file system ({fstype}): SQLite's locks "
            "are not reliable there, and workers on several hosts must not share it. Use "
            "PostgreSQL for leases across machines"))
    return found


def filesystem_type(path: str) -> str | None:
    """The type of the file system holding ``path``, from /proc/mounts (Linux)."""
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            entries = [line.split()[1:3] for line in mounts if len(line.split()) >= 3]
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for mount_point, fstype in entries:
        mount_point = mount_point.replace("\\040", " ")
        inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
        if inside and (best is None or len(mount_point) > best[0]):
            best = (len(mount_point), fstype)
    return best[1] if best else None
