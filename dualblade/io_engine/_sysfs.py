"""Reading block-device facts from sysfs and the mount table (no writes, no ioctls)."""

from __future__ import annotations

import os
from pathlib import Path

SYS_DEV_BLOCK = Path("/sys/dev/block")


def device_number(path: str) -> tuple[int, int]:
    """``(major, minor)`` of a device node."""
    rdev = os.stat(path).st_rdev
    return os.major(rdev), os.minor(rdev)


def sysfs_dir(major: int, minor: int) -> Path:
    """The device's sysfs folder (resolved, so ``partition`` and ``queue`` are findable)."""
    return (SYS_DEV_BLOCK / f"{major}:{minor}").resolve()


def read_int(path: Path, default: int | None = None) -> int | None:
    """An integer sysfs attribute, or ``default`` if absent."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return default


def queue_limits(major: int, minor: int) -> dict[str, int]:
    """``max_sectors_kb``, ``max_hw_sectors_kb``, ``max_segments``, ``logical_block_size``,
    ``discard_max_bytes`` of the device's request queue (a partition reads its disk's queue)."""
    folder = sysfs_dir(major, minor)
    queue = folder / "queue"
    if not queue.exists() and (folder / "partition").exists():
        queue = folder.parent / "queue"
    names = (
        "max_sectors_kb",
        "max_hw_sectors_kb",
        "max_segments",
        "logical_block_size",
        "discard_max_bytes",
    )
    out: dict[str, int] = {}
    for name in names:
        value = read_int(queue / name)
        if value is not None:
            out[name] = value
    return out


def partitions(major: int, minor: int) -> list[tuple[str, int, int]]:
    """``(name, major, minor)`` of each partition of a whole disk."""
    folder = sysfs_dir(major, minor)
    found: list[tuple[str, int, int]] = []
    if not folder.is_dir():
        return found
    for child in sorted(folder.iterdir()):
        if (child / "partition").exists():
            dev = (child / "dev").read_text().strip()
            maj, mnr = dev.split(":")
            found.append((child.name, int(maj), int(mnr)))
    return found


def holders(major: int, minor: int) -> list[str]:
    """Kernel users stacked on the device (device-mapper, md, bcache ...)."""
    folder = sysfs_dir(major, minor) / "holders"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def mounted_devices() -> dict[tuple[int, int], str]:
    """``(major, minor) -> mount point`` from ``/proc/self/mountinfo``."""
    mounts: dict[tuple[int, int], str] = {}
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return mounts
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        major, minor = fields[2].split(":")
        mounts.setdefault((int(major), int(minor)), fields[4])
    return mounts


def swap_devices() -> set[str]:
    """Paths of active swap areas."""
    try:
        lines = Path("/proc/swaps").read_text().splitlines()[1:]
    except OSError:
        return set()
    return {line.split()[0] for line in lines if line.strip()}
