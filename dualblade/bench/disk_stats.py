"""Device busy time and throughput from ``/sys/block/<dev>/stat``.

The block layer keeps, per device, sectors read and written and ``io_ticks``: milliseconds during
which at least one request was in flight. Two snapshots around a phase give the device's busy
share (``Δio_ticks / Δwall``, the "SSD utilization" of the paper) and its throughput. The device is
the one holding the file (its ``st_dev``), or the disk itself for a block device; a partition has
its own ``stat`` file, so partition and whole disk both work.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

SECTOR = 512


@dataclass(frozen=True)
class DiskSnapshot:
    """One reading of a device's counters."""

    at: float
    sectors_read: int
    sectors_written: int
    io_ticks_ms: int


def stat_file_for(path: str | os.PathLike[str]) -> Path | None:
    """The ``stat`` file of the block device that stores ``path`` (None if there is none, as for
    tmpfs or overlay file systems on a device without a block node)."""
    info = os.stat(path)
    dev = info.st_rdev if stat.S_ISBLK(info.st_mode) else info.st_dev
    node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    candidate = node / "stat"
    return candidate if candidate.exists() else None


def read_snapshot(stat_file: Path) -> DiskSnapshot:
    """Read the counters (field order from the kernel's Documentation/block/stat.rst)."""
    fields = [int(x) for x in stat_file.read_text().split()]
    return DiskSnapshot(
        at=time.perf_counter(),
        sectors_read=fields[2],
        sectors_written=fields[6],
        io_ticks_ms=fields[9],
    )


@dataclass(frozen=True)
class DiskActivity:
    """What a device did between two snapshots."""

    seconds: float
    read_bytes: int
    written_bytes: int
    busy_fraction: float

    @property
    def read_bytes_per_s(self) -> float:
        return self.read_bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def write_bytes_per_s(self) -> float:
        return self.written_bytes / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {
            "seconds": round(self.seconds, 6),
            "read_bytes": self.read_bytes,
            "written_bytes": self.written_bytes,
            "read_bytes_per_s": round(self.read_bytes_per_s),
            "write_bytes_per_s": round(self.write_bytes_per_s),
            "busy_percent": round(100 * self.busy_fraction, 2),
        }


def activity(before: DiskSnapshot, after: DiskSnapshot) -> DiskActivity:
    """The device's traffic and busy share from ``before`` to ``after``."""
    seconds = after.at - before.at
    busy = (after.io_ticks_ms - before.io_ticks_ms) / 1e3
    return DiskActivity(
        seconds=seconds,
        read_bytes=(after.sectors_read - before.sectors_read) * SECTOR,
        written_bytes=(after.sectors_written - before.sectors_written) * SECTOR,
        busy_fraction=min(1.0, busy / seconds) if seconds > 0 else 0.0,
    )
