"""Each running store's page-cache folder, locked while the store lives; dead stores' folders.

A store keeps its page-cache files in ``<page_cache_dir>/store-<pid>-<random>/`` and holds an
exclusive ``flock`` on the ``owner.lock`` file inside for its whole life. The kernel drops a
flock when the last descriptor of its holder goes, however the process ends (``kill -9`` too, and
only once the dead process's in-flight I/O is over), so a folder whose lock can be taken belongs
to nobody: :func:`remove_dead_folders` removes it. PIDs are not trusted for that (they are
reused, and a PID namespace hides them); the owner record in the lock file is for the log.

A folder is made under a hidden name, locked, and only then renamed into place, so a scan never
meets a ``store-*`` folder whose owner has not taken its lock yet.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dualblade.io_engine import TargetError

#: The lock file in each store's folder.
LOCK_NAME = "owner.lock"
#: Store folders in the page-cache folder; the second is one being set up.
PREFIX = "store-"
STARTING_PREFIX = ".starting-store-"
#: A folder with no lock file (made by a dualblade from before the lock, or by a store that died
#: in the moment between making its folder and locking it) counts as dead once it has been left
#: untouched this long.
UNLOCKED_GRACE_S = 60.0


def _owner_record() -> dict[str, Any]:
    """Who holds a folder: for the log of whoever reclaims it after a crash."""
    record: dict[str, Any] = {"pid": os.getpid(), "started_at": time.time()}
    with contextlib.suppress(OSError, IndexError, ValueError):
        # Field 22 of /proc/self/stat: start time in clock ticks since boot (after the name,
        # which may hold spaces, so split after its closing parenthesis).
        stat = Path("/proc/self/stat").read_text()
        record["start_ticks"] = int(stat.rsplit(")", 1)[1].split()[19])
    with contextlib.suppress(OSError):
        record["boot_id"] = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return record


class StoreFolder:
    """This store's page-cache folder, locked until :meth:`close` removes it."""

    def __init__(self, path: Path, lock_fd: int) -> None:
        self.path = path
        self._lock_fd = lock_fd

    def close(self) -> None:
        """Remove the folder and whatever is left in it, then drop the lock (idempotent).

        The folder goes first, while the lock is still held: no scan can take it for dead and
        race this removal.
        """
        fd, self._lock_fd = self._lock_fd, -1
        if fd < 0:
            return
        try:
            shutil.rmtree(self.path, ignore_errors=True)
        finally:
            os.close(fd)


def claim_store_folder(page_cache_dir: Path) -> StoreFolder:
    """A new, locked, owner-only folder for one store's page-cache files in ``page_cache_dir``.

    Raises:
        TargetError: the folder cannot be made (permission, a read-only or full file system).
    """
    try:
        os.makedirs(page_cache_dir, mode=0o700, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=STARTING_PREFIX, dir=page_cache_dir))  # 0700
    except OSError as error:
        raise TargetError(
            f"cannot make a page-cache folder in {page_cache_dir}: {error.strerror}; set "
            "storage.page_cache_dir to a writable folder"
        ) from error
    try:
        fd = os.open(staging / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise TargetError(
            f"cannot lock the page-cache folder {staging}: {error.strerror}"
        ) from error
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else has it
        with contextlib.suppress(OSError):  # only for the log; a full disk must not stop a start
            os.write(fd, json.dumps(_owner_record()).encode())
        final = page_cache_dir / f"{PREFIX}{os.getpid()}-{staging.name[len(STARTING_PREFIX) :]}"
        os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        os.close(fd)
        raise
    return StoreFolder(final, fd)


@dataclass(frozen=True)
class DeadFolder:
    """The folder of a store that died without cleaning up, as it was found."""

    path: Path
    owner: dict[str, Any] | None  # its owner record; None for a folder without a lock file
    files: int  # page-cache files in it
    bytes: int  # their allocated bytes on disk
    removed: bool  # False: it could not be removed (permission), and is still there


def _folder_usage(folder: Path) -> tuple[int, int]:
    """Files and their allocated bytes under ``folder`` (the lock file not counted)."""
    files = size = 0
    for root, _, names in os.walk(folder):
        for name in names:
            if name == LOCK_NAME and Path(root) == folder:
                continue
            with contextlib.suppress(OSError):
                size += os.lstat(os.path.join(root, name)).st_blocks * 512
                files += 1
    return files, size


def _read_owner(fd: int) -> dict[str, Any] | None:
    try:
        data = os.pread(fd, 4096, 0)
        record = json.loads(data) if data else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _take_if_dead(folder: Path) -> tuple[bool, int, dict[str, Any] | None]:
    """Whether ``folder``'s store is dead; if so, its lock (held: -1 for none) and record."""
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        try:
            age = time.time() - folder.lstat().st_mtime
        except OSError:
            return False, -1, None
        return age > UNLOCKED_GRACE_S, -1, None
    except OSError:
        return False, -1, None  # not ours to judge (permission, a link)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False, -1, None  # alive (EWOULDBLOCK: its store holds the lock), or not ours
    return True, fd, _read_owner(fd)


def remove_dead_folders(page_cache_dir: Path) -> list[DeadFolder]:
    """Find the folders of dead stores in ``page_cache_dir`` and remove them.

    Only entries named like store folders are looked at, links never followed; a live store's
    folder (its lock held, by this process or another) is left alone.
    """
    try:
        entries = list(os.scandir(page_cache_dir))
    except FileNotFoundError:
        return []
    found: list[DeadFolder] = []
    for entry in entries:
        if not entry.name.startswith((PREFIX, STARTING_PREFIX)):
            continue
        if not entry.is_dir(follow_symlinks=False):
            continue
        folder = Path(entry.path)
        dead, lock_fd, owner = _take_if_dead(folder)
        if not dead:
            continue
        try:
            files, size = _folder_usage(folder)
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            if lock_fd >= 0:
                os.close(lock_fd)
        found.append(DeadFolder(folder, owner, files, size, removed=not folder.exists()))
    return found
