"""Memory cgroups for the sweep: each (policy, limit) run lives in a group of its own.

A memory limit only means something if the page cache is charged against it, which is what a
memory cgroup does (anonymous memory and the page cache of the files its processes touch). Two
hierarchies exist:

- cgroup v2 (unified): ``memory.max``; a child group is created under ``/sys/fs/cgroup`` as root,
  or under the caller's own group where it has been delegated (writable, with ``memory`` in its
  ``cgroup.subtree_control``).
- cgroup v1: the memory controller's own tree, ``/sys/fs/cgroup/memory``, with
  ``memory.limit_in_bytes``; creating a group there needs root (as on the development machines).

The group is made, limited, and joined by the worker process itself (it writes its pid into
``cgroup.procs`` before it imports torch), so nothing but the run is charged to it; the group is
removed when the run is over, or when the sweep is stopped (Ctrl-C, SIGTERM). A sweep killed
outright (SIGKILL, the OOM killer) cannot remove it: :func:`remove_stale_groups`, called as
each sweep starts, removes the empty groups of dualblade processes that are gone.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dualblade.errors import DualbladeError
from dualblade.logs import get_logger

CGROUP_ROOT = Path("/sys/fs/cgroup")

Version = Literal["v1", "v2"]

#: The names this package gives its groups, each with the pid of the process that made it:
#: a run's ``dualblade-run-<pid>-<label>`` (:func:`run_group_name`) and the permission probe's
#: ``dualblade-probe-<pid>``.
_OWNED_GROUP = re.compile(r"dualblade-(?:run-(\d+)-.+|probe-(\d+))")

_log = get_logger(__name__)


class CgroupError(DualbladeError):
    """A memory cgroup cannot be created or used here; the message says what is missing."""


@dataclass(frozen=True)
class MemoryCgroup:
    """One memory cgroup directory and the hierarchy it belongs to."""

    path: Path
    version: Version

    @property
    def limit_file(self) -> Path:
        return self.path / ("memory.max" if self.version == "v2" else "memory.limit_in_bytes")

    def set_limit(self, nbytes: int) -> None:
        """Cap the group's memory (anonymous + page cache) at ``nbytes``."""
        _write(self.limit_file, str(nbytes))

    def join(self, pid: int) -> None:
        """Move process ``pid`` (and its future threads) into the group."""
        _write(self.path / "cgroup.procs", str(pid))

    def stat(self) -> dict[str, int]:
        """The group's ``memory.stat`` counters."""
        out: dict[str, int] = {}
        for line in (self.path / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[key] = int(value)
        return out

    def peak_bytes(self) -> int | None:
        """The most memory the group held (``memory.peak`` / ``max_usage_in_bytes``)."""
        name = "memory.peak" if self.version == "v2" else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def oom_kills(self) -> int:
        """The kernel's OOM kills in the group (``memory.events`` / ``memory.oom_control``)."""
        name = "memory.events" if self.version == "v2" else "memory.oom_control"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def __enter__(self) -> MemoryCgroup:
        return self

    def __exit__(self, *ignored: object) -> None:
        """Leaving the block removes the group, whatever ended it (a signal's exception too)."""
        self.remove()

    def remove(self, timeout: float = 5.0) -> None:
        """Delete the group once its processes are gone (rmdir; retried while it empties)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except PermissionError as error:
        raise CgroupError(f"cannot write {path}: permission denied (run as root)") from error
    except OSError as error:
        raise CgroupError(f"cannot write {text!r} to {path}: {error.strerror}") from error


def detect_version(root: Path = CGROUP_ROOT) -> Version | None:
    """``v2`` when the unified hierarchy has the memory controller, ``v1`` when the v1 memory
    controller is mounted, else None."""
    controllers = root / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        return "v2"
    if (root / "memory" / "memory.limit_in_bytes").exists():
        return "v1"
    return None


def _own_v2_group(root: Path) -> Path | None:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return root / line[3:].lstrip("/")
    except OSError:
        return None
    return None


def _v2_parent(root: Path) -> Path:
    candidates = [root]
    own = _own_v2_group(root)
    if own is not None and own != root:
        candidates.append(own)
    for parent in candidates:
        subtree = parent / "cgroup.subtree_control"
        try:
            enabled = subtree.read_text().split()
        except OSError:
            continue
        if "memory" in enabled and os.access(parent, os.W_OK):
            return parent
    raise CgroupError(
        "cgroup v2 is in use but no group with the memory controller enabled is writable here "
        f"(tried {', '.join(str(c) for c in candidates)}): run as root, or delegate a cgroup "
        "to this user with +memory in its cgroup.subtree_control"
    )


def run_group_name(label: str) -> str:
    """The name of this process's group for the run ``label``: the pid in it tells
    :func:`remove_stale_groups` whether its maker is gone."""
    return f"dualblade-run-{os.getpid()}-{label}"


def create_memory_cgroup(name: str, limit_bytes: int, root: Path = CGROUP_ROOT) -> MemoryCgroup:
    """Create (or reuse) the group ``name`` with its memory limit set.

    Raises:
        CgroupError: no memory controller, or no permission to create a group; the message
            names the directory and what to do.
    """
    version = detect_version(root)
    if version is None:
        raise CgroupError(
            f"no memory cgroup controller found under {root} (neither cgroup v2 with 'memory' in "
            "cgroup.controllers nor a v1 'memory' hierarchy): a memory-limit sweep needs one"
        )
    parent = _v2_parent(root) if version == "v2" else root / "memory"
    path = parent / name
    try:
        path.mkdir(exist_ok=True)
    except PermissionError as error:
        raise CgroupError(
            f"cannot create the memory cgroup {path}: permission denied — run `dualblade bench` "
            "as root (cgroup v1 groups can only be created by root)"
        ) from error
    except OSError as error:
        raise CgroupError(f"cannot create the memory cgroup {path}: {error.strerror}") from error
    group = MemoryCgroup(path, version)
    try:
        group.set_limit(limit_bytes)
    except CgroupError:
        group.remove()
        raise
    return group


def _process_is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def remove_stale_groups(root: Path = CGROUP_ROOT) -> list[Path]:
    """Remove the groups a dualblade process made and left behind when it was killed outright
    (see the module); returns those removed.

    Only a group named as this package names its groups (:data:`_OWNED_GROUP`) whose maker is
    no longer running is touched, and only with ``rmdir``, which the kernel refuses while a
    process is still inside (a worker that outlived its sweep): that group is left for a later
    sweep. A pid reused by a live process keeps its group too.
    """
    version = detect_version(root)
    if version is None:
        return []
    try:
        parent = _v2_parent(root) if version == "v2" else root / "memory"
        children = [path for path in parent.iterdir() if path.is_dir()]
    except (CgroupError, OSError):
        return []
    removed = []
    for path in children:
        match = _OWNED_GROUP.fullmatch(path.name)
        if match is None or not _process_is_gone(int(match.group(1) or match.group(2))):
            continue
        try:
            path.rmdir()
        except OSError as error:
            _log.warning("stale cgroup kept", path=str(path), reason=error.strerror)
            continue
        removed.append(path)
    if removed:
        _log.info("stale cgroups removed", paths=[str(path) for path in removed])
    return removed


def can_create_memory_cgroups(root: Path = CGROUP_ROOT) -> str | None:
    """None when a sweep can make its groups here, else the reason it cannot (for skips)."""
    try:
        with create_memory_cgroup(f"dualblade-probe-{os.getpid()}", 1 << 30, root):
            return None
    except CgroupError as error:
        return str(error)
