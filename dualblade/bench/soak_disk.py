"""The full-disk soak's scratch folder: a small tmpfs, so that contexts meet a full disk for real.

The soak's contexts want more room than the file system has, and a :class:`DiskFiller` (another
tenant of the disk) takes all that is free now and then: claims of direct runs fail to grow the
file, page-cache files find no room to be allocated, and writes into runs punched by earlier
contexts find no blocks. Each is an ENOSPC the context that met it must see as
:class:`~dualblade.io_engine.IOFailedError`, while the others go on. A tmpfs is used because it
fills up exactly at its size, needs no device, and (since Linux 6.6) takes O_DIRECT.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio

from dualblade.bench.soak_options import SoakOptions
from dualblade.errors import ConfigError

#: Room per concurrent context: under ``dual`` one context's storage, once all its layers are
#: touched, is about 1.4 MiB (a 1 MiB direct run and four 96 KiB page-cache files).
ROOM_PER_CONTEXT = 1 << 20
MIN_ROOM = 2 << 20


def full_disk_bytes(options: SoakOptions) -> int:
    """The size of the file system a full-disk soak runs on: about a third of what its contexts
    would hold at once, so that some of them always find it full."""
    return max(MIN_ROOM, options.contexts * ROOM_PER_CONTEXT)


@contextlib.contextmanager
def small_file_system(parent: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes on a new folder in ``parent``; unmounted and removed after.

    Raises:
        ConfigError: not root, or the mount failed (the message says why).
    """
    if os.geteuid() != 0:
        raise ConfigError("--full-disk mounts a small tmpfs, which needs root; run it with sudo")
    mount_point = Path(tempfile.mkdtemp(prefix="soak-disk-", dir=parent))
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        os.rmdir(mount_point)
        raise ConfigError(
            f"cannot mount a {size}-byte tmpfs on {mount_point} for --full-disk: "
            f"{result.stderr.strip() or 'mount failed'}"
        )
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], check=False)
        shutil.rmtree(mount_point, ignore_errors=True)


class DiskFiller:
    """Another tenant of the disk: takes every free block for a moment, then gives it back.

    Without it, a context handed a run its predecessor punched would mostly find those very
    blocks free again; with it, writes into punched runs meet a full disk too.
    """

    def __init__(self, folder: Path, seed: int) -> None:
        self.path = folder / "filler"
        self.rng = random.Random(seed)
        self.fills = 0

    def _fill(self) -> None:
        stat = os.statvfs(self.path.parent)
        free = stat.f_bavail * stat.f_frsize
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(4096, free))
        except OSError as error:
            if error.errno != errno.ENOSPC:  # a store took some meanwhile: filled anyway
                raise
        finally:
            os.close(fd)
        self.fills += 1

    async def run(self) -> None:
        """Fill and free the disk at random moments until cancelled."""
        try:
            while True:
                await anyio.sleep(self.rng.uniform(0.05, 0.3))
                await anyio.to_thread.run_sync(self._fill)
                await anyio.sleep(self.rng.uniform(0.05, 0.3))
                self.path.unlink(missing_ok=True)
        finally:
            self.path.unlink(missing_ok=True)
