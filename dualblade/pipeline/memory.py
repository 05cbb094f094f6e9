"""Memory discovery: how much memory this process may use, and how much of it is page cache.

The page-cache budget only makes sense against the limit the kernel will actually enforce, and on
the machines dualblade targets that is a cgroup's, not the host's: a memory-limit sweep runs the
process in a cgroup, and containers live in one. So the reader finds *this process's* memory
cgroup through ``/proc/self/cgroup`` and ``/proc/self/mountinfo`` (hybrid hosts mount v1 and v2 at
once), then reads

- cgroup v2: ``memory.max`` and ``memory.high`` of the group and each ancestor up to the mount
  (the tightest wins: a parent's limit binds its children), ``memory.current``, and
  ``active_file`` + ``inactive_file`` of ``memory.stat``;
- cgroup v1: ``memory.limit_in_bytes`` and ``hierarchical_memory_limit``, ``memory.usage_in_bytes``,
  and ``total_active_file`` + ``total_inactive_file`` of ``memory.stat``;
- always ``/proc/meminfo`` (``MemTotal``, ``MemAvailable``, ``Active(file)``, ``Inactive(file)``).

File-backed LRU pages count as reclaimable: they are the page cache the budget hands out, so they
are not "used" for the budget's purpose. Shared memory (tmpfs) is file-backed for the kernel but
sits on the anon LRU, so it correctly counts as used.

Every function takes ``root`` (default ``/``) under which ``proc/`` and the cgroup mount points are
looked up, so tests point them at recorded trees.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from dualblade.logs import get_logger
from dualblade.pipeline.errors import MemoryDiscoveryError

# cgroup v1 writes "no limit" as PAGE_COUNTER_MAX * PAGE_SIZE (9223372036854771712 on x86_64);
# anything this large is no limit on any machine that exists.
_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class HostMemory:
    """The host's view from ``/proc/meminfo``, in bytes."""

    total_bytes: int
    available_bytes: int
    file_bytes: int


@dataclass(frozen=True)
class CgroupMemory:
    """One memory cgroup's limit and usage, in bytes."""

    version: Literal[1, 2]
    path: str
    limit_bytes: int | None
    usage_bytes: int
    file_bytes: int
    #: Kernel memory the group is charged for that the kernel frees with the page cache or
    #: reclaims like it: cgroup v2's ``slab_reclaimable``, most of it the page cache's own
    #: metadata (ext4's buffer heads and the page tree's nodes, about 2.7 % of the cached bytes:
    #: 56 MiB for 2 GiB written to a file, all of it gone once the pages were dropped). Counted
    #: as in use, it pulled the budget under a plan the prefill was filling: OPT-6.7B at 11 GiB
    #: on an H100 lost 0.63 GiB of budget over its prefill, 0.22 GiB of it this metadata, and the
    #: store demoted a layer in the first decode step (docs/bench.md, thirtieth session). cgroup
    #: v1's ``memory.stat`` has no slab figures: 0 there.
    reclaimable_kernel_bytes: int = 0

    @property
    def non_file_bytes(self) -> int:
        """Charged memory that is not reclaimable page cache (anon, shmem, unreclaimable kernel
        memory, and file pages mapped into processes)."""
        return max(0, self.usage_bytes - self.file_bytes - self.reclaimable_kernel_bytes)


@dataclass(frozen=True)
class MemorySnapshot:
    """What discovery found: the host always, the process's memory cgroup when it has one."""

    host: HostMemory
    cgroup: CgroupMemory | None


@dataclass(frozen=True)
class CgroupLocation:
    """Where this process's memory cgroup lives: its hierarchy version, directory and mount."""

    version: Literal[1, 2]
    path: str
    directory: Path
    mount_point: Path


def discover_memory(root: Path = Path("/")) -> MemorySnapshot:
    """Read the host's memory and this process's memory cgroup under ``root``.

    A cgroup whose files cannot be read is logged and left out (the host numbers still bound the
    budget); an unreadable ``/proc/meminfo`` is an error.

    Raises:
        MemoryDiscoveryError: ``/proc/meminfo`` is missing or malformed.
    """
    host = read_meminfo(root)
    location = find_memory_cgroup(root)
    if location is None:
        return MemorySnapshot(host, None)
    try:
        if location.version == 1:
            cgroup = read_cgroup_v1(location.directory, location.path)
        else:
            cgroup = read_cgroup_v2(location.directory, location.mount_point, location.path)
    except MemoryDiscoveryError as error:
        get_logger(__name__).warning("cgroup_unreadable", path=location.path, error=str(error))
        return MemorySnapshot(host, None)
    return MemorySnapshot(host, cgroup)


def read_meminfo(root: Path = Path("/")) -> HostMemory:
    """Parse ``/proc/meminfo`` under ``root``.

    Raises:
        MemoryDiscoveryError: the file is missing or lacks ``MemTotal``/``MemAvailable``.
    """
    fields = _read_key_values(root / "proc" / "meminfo", unit_kib=True)
    try:
        return HostMemory(
            total_bytes=fields["MemTotal"],
            available_bytes=fields["MemAvailable"],
            file_bytes=fields.get("Active(file)", 0) + fields.get("Inactive(file)", 0),
        )
    except KeyError as missing:
        raise MemoryDiscoveryError(f"{root / 'proc/meminfo'} has no {missing} line") from None


def find_memory_cgroup(root: Path = Path("/")) -> CgroupLocation | None:
    """Locate this process's memory cgroup, preferring v1's memory controller on hybrid hosts.

    Returns None when the process is in no memory cgroup with accounting files (no cgroup mounts,
    or the v2 root cgroup, which has no ``memory.current``).
    """
    membership = _read_text(root / "proc/self/cgroup", missing_ok=True) or ""
    v1_path = v2_path = None
    for line in membership.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2_path = path
        elif "memory" in controllers.split(","):
            v1_path = path
    mounts = _cgroup_mounts(root)
    if v1_path is not None and "cgroup" in mounts:
        mount_root, mount_point = mounts["cgroup"]
        directory = _inside(root, mount_point, mount_root, v1_path)
        if (directory / "memory.limit_in_bytes").exists():
            return CgroupLocation(1, v1_path, directory, root / mount_point.lstrip("/"))
    if v2_path is not None and "cgroup2" in mounts:
        mount_root, mount_point = mounts["cgroup2"]
        directory = _inside(root, mount_point, mount_root, v2_path)
        if (directory / "memory.current").exists():
            return CgroupLocation(2, v2_path, directory, root / mount_point.lstrip("/"))
    return None


def read_cgroup_v2(directory: Path, mount_point: Path, path: str = "") -> CgroupMemory:
    """Read a cgroup v2 group; its limit is the tightest ``memory.max``/``memory.high`` of it and
    its ancestors below ``mount_point``.

    Raises:
        MemoryDiscoveryError: ``memory.current`` or ``memory.stat`` cannot be read.
    """
    limit: int | None = None
    node = directory
    while True:
        for name in ("memory.max", "memory.high"):
            value = _parse_limit(_read_text(node / name, missing_ok=True))
            if value is not None:
                limit = value if limit is None else min(limit, value)
        if node == mount_point or node.parent == node or mount_point not in node.parents:
            break
        node = node.parent
    usage = _parse_int(_read_text(directory / "memory.current"), directory / "memory.current")
    stat = _read_key_values(directory / "memory.stat")
    file_bytes = _unmapped_file(stat, "active_file", "inactive_file", "file_mapped", "shmem")
    slab = stat.get("slab_reclaimable", 0)
    return CgroupMemory(2, path or str(directory), limit, usage, file_bytes, slab)


def read_cgroup_v1(directory: Path, path: str = "") -> CgroupMemory:
    """Read a cgroup v1 memory group; ``hierarchical_memory_limit`` carries its ancestors' limits.

    ``memory.usage_in_bytes`` is batched per CPU and may be off by a few hundred KiB; that is far
    below any safety margin, so the simple file the kernel documents is good enough here.

    Raises:
        MemoryDiscoveryError: ``memory.usage_in_bytes`` or ``memory.stat`` cannot be read.
    """
    stat = _read_key_values(directory / "memory.stat")
    limits = [
        _parse_limit(_read_text(directory / "memory.limit_in_bytes", missing_ok=True)),
        _parse_limit(str(stat["hierarchical_memory_limit"]))
        if "hierarchical_memory_limit" in stat
        else None,
    ]
    known = [value for value in limits if value is not None]
    usage_file = directory / "memory.usage_in_bytes"
    usage = _parse_int(_read_text(usage_file), usage_file)
    prefix = "total_" if "total_active_file" in stat else ""
    file_bytes = _unmapped_file(
        stat,
        f"{prefix}active_file",
        f"{prefix}inactive_file",
        f"{prefix}mapped_file",
        f"{prefix}shmem",
    )
    return CgroupMemory(1, path or str(directory), min(known) if known else None, usage, file_bytes)


def _unmapped_file(
    stat: dict[str, int], active: str, inactive: str, mapped: str, shmem: str
) -> int:
    """Page-cache bytes the budget may count as reclaimable: the file LRU pages minus those mapped
    into processes. Mapped file pages are the code and libraries the processes run (torch's
    shared objects alone are hundreds of MiB); reclaiming them would thrash the processes, and
    the kernel protects them, so budgeting them as room for KV pages would make the budgeted KV
    pages the ones evicted.

    The mapped count also holds mapped shared memory, which is not on the file LRU at all:
    subtracting it too once counted a process's shared buffers twice against the budget (the
    store's own I/O buffers were shared mappings), and the budget swung as the cache came and
    went. So only mapped pages beyond the shared memory are taken off."""
    mapped_file = max(0, stat.get(mapped, 0) - stat.get(shmem, 0))
    return max(0, stat.get(active, 0) + stat.get(inactive, 0) - mapped_file)


def _cgroup_mounts(root: Path) -> dict[str, tuple[str, str]]:
    """fstype -> (root of the hierarchy at the mount, mount point), for v2 and v1-with-memory."""
    found: dict[str, tuple[str, str]] = {}
    text = _read_text(root / "proc/self/mountinfo", missing_ok=True) or ""
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if dash < 5 or len(fields) < dash + 3:
            continue
        fstype, super_options = fields[dash + 1], fields[dash + 3] if len(fields) > dash + 3 else ""
        mount_root, mount_point = fields[3], fields[4]
        if fstype == "cgroup2" or (fstype == "cgroup" and "memory" in super_options.split(",")):
            found.setdefault(fstype, (mount_root, mount_point))
    return found


def _inside(root: Path, mount_point: str, mount_root: str, cgroup_path: str) -> Path:
    """The directory of ``cgroup_path`` under a mount showing the hierarchy from ``mount_root``."""
    relative = PurePosixPath(cgroup_path)
    try:
        relative = relative.relative_to(mount_root)
    except ValueError:
        # A cgroup namespace or bind mount hides the group's ancestors; the mount itself is the
        # closest view of our group that is visible.
        relative = PurePosixPath(".")
    parts = [part for part in relative.parts if part not in ("/", ".")]
    return root.joinpath(mount_point.lstrip("/"), *parts)


def _read_text(path: Path, missing_ok: bool = False) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        if missing_ok:
            return None
        raise MemoryDiscoveryError(f"{path} does not exist") from None
    except OSError as error:
        if missing_ok:
            return None
        raise MemoryDiscoveryError(f"cannot read {path}: {error.strerror}") from None


def _read_key_values(path: Path, unit_kib: bool = False) -> dict[str, int]:
    """``key value [kB]`` lines (``memory.stat``, ``/proc/meminfo``) as a dict of byte counts."""
    text = _read_text(path)
    assert text is not None
    values: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[1].isdigit():
            scale = 1024 if unit_kib and len(parts) > 2 and parts[2] == "kB" else 1
            values[parts[0]] = int(parts[1]) * scale
    if not values:
        raise MemoryDiscoveryError(f"{path} has no 'key value' lines")
    return values


def _parse_limit(text: str | None) -> int | None:
    if text is None:
        return None
    value = text.strip()
    if value in ("", "max"):
        return None
    try:
        number = int(value)
    except ValueError:
        raise MemoryDiscoveryError(f"not a memory limit: {value!r}") from None
    return None if number >= _UNLIMITED else number


def _parse_int(text: str | None, path: Path) -> int:
    try:
        return int((text or "").strip())
    except ValueError:
        raise MemoryDiscoveryError(f"{path} does not hold a number: {text!r}") from None
