"""Before a store serves: reclaim what a dead predecessor left, and say what it was.

A store killed mid-request (``kill -9``, a crash, a lost machine) leaves its page-cache files
and the KV bytes of its direct runs behind: users' prompts in another form. A store that starts
removes them before its first context opens:

- **page-cache files**: every store keeps them in a folder it holds a lock on
  (:mod:`.store_folder`); folders whose lock nobody holds are removed.
- **direct extents**: the store holds the direct target's exclusive lock (taken just before),
  so nobody else can be using any block of the configured extent: whatever holds data there is a
  predecessor's, and is discarded (punch hole, BLKDISCARD, NVMe Deallocate). A file target says
  which parts hold data (``SEEK_DATA``), so only those are punched and counted; a device cannot
  say, so its whole extent is discarded. Nothing outside the configured extent is touched.

A device that cannot discard keeps the bytes; the store then never serves them anyway (a context
reads only rows it wrote), and the log says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import anyio

from dualblade.io_engine import IOEngine, IOFailedError, Target, TargetError
from dualblade.logs import get_logger
from dualblade.store.store_folder import DeadFolder, remove_dead_folders

_log = get_logger(__name__)


@dataclass(frozen=True)
class Reclaimed:
    """What a store found of dead predecessors when it started, removed before it served.

    Attributes:
        store_folders: page-cache folders of stores that died without cleaning up.
        files: page-cache files in them.
        file_bytes: the bytes those files held on disk (allocated blocks).
        direct_extents: runs of the direct extent that held data and were discarded (on a
            device, which cannot tell, 1 for the whole extent).
        direct_bytes: bytes of those runs.
        direct_exact: ``direct_bytes`` is what held data (a file target), not the whole
            extent discarded because a device cannot tell.
        left_behind: folders that could not be removed and discards that failed (logged).
        seconds: how long the reclaim took.
    """

    store_folders: int = 0
    files: int = 0
    file_bytes: int = 0
    direct_extents: int = 0
    direct_bytes: int = 0
    direct_exact: bool = True
    left_behind: int = 0
    seconds: float = 0.0

    @property
    def bytes(self) -> int:
        """Page-cache and direct bytes reclaimed together."""
        return self.file_bytes + self.direct_bytes

    def to_dict(self) -> dict[str, object]:
        """JSON-ready, with ``bytes`` included."""
        return {
            "store_folders": self.store_folders,
            "files": self.files,
            "file_bytes": self.file_bytes,
            "direct_extents": self.direct_extents,
            "direct_bytes": self.direct_bytes,
            "direct_exact": self.direct_exact,
            "left_behind": self.left_behind,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 4),
        }


def extent_bytes(target: Target, first_lba: int, n_blocks: int | None) -> tuple[int, int]:
    """The configured extent as a byte range ``(start, end)``; a growable file's runs to its
    current end (a predecessor may have grown it)."""
    start = first_lba * target.lba_size
    end = (first_lba + n_blocks) * target.lba_size if n_blocks is not None else target.size
    return start, max(start, min(end, target.size))


async def reclaim_direct(
    engine: IOEngine, target: Target, first_lba: int, n_blocks: int | None
) -> tuple[list[tuple[int, int]], bool]:
    """Discard what holds data in the configured extent; returns the ranges and whether they
    are exactly what held data (False: a device's whole extent).

    The caller must hold the target's exclusive lock: every byte in the extent is then dead.

    Raises:
        TargetError: the target cannot discard (a device without TRIM).
        IOFailedError: a discard failed.
    """
    start, end = extent_bytes(target, first_lba, n_blocks)
    if end <= start:
        return [], True
    found = await anyio.to_thread.run_sync(target.allocated_ranges, start, end - start)
    ranges, exact = (found, True) if found is not None else ([(start, end - start)], False)
    for offset, length in ranges:
        await engine.trim(target, offset, length)
    return ranges, exact


def _owners(folders: list[DeadFolder]) -> list[object]:
    return [folder.owner.get("pid") if folder.owner else None for folder in folders]


async def reclaim_predecessors(
    engine: IOEngine,
    direct: Target,
    first_lba: int,
    n_blocks: int | None,
    page_cache_dir: Path,
) -> Reclaimed:
    """Remove dead stores' page-cache folders in ``page_cache_dir`` and discard the data in
    ``direct``'s configured extent (whose exclusive lock the caller holds); log what was
    reclaimed. A folder or discard that fails is logged and counted in ``left_behind``: the
    store still starts, and never serves those bytes.
    """
    began = time.perf_counter()
    folders = await anyio.to_thread.run_sync(remove_dead_folders, page_cache_dir)
    left_behind = sum(not folder.removed for folder in folders)
    ranges: list[tuple[int, int]] = []
    exact = True
    try:
        ranges, exact = await reclaim_direct(engine, direct, first_lba, n_blocks)
    except (TargetError, IOFailedError) as error:  # a device without discard, or failing
        left_behind += 1
        _log.warning(
            "cannot discard a predecessor's direct extent; its bytes stay on the device but "
            "are never served (a context reads only rows it wrote)",
            target=direct.name,
            error=str(error),
        )
    reclaimed = Reclaimed(
        store_folders=len(folders),
        files=sum(folder.files for folder in folders),
        file_bytes=sum(folder.bytes for folder in folders),
        direct_extents=len(ranges),
        direct_bytes=sum(length for _, length in ranges),
        direct_exact=exact,
        left_behind=left_behind,
        seconds=time.perf_counter() - began,
    )
    if folders or (ranges and exact):
        _log.info(
            "reclaimed what dead stores left",
            page_cache_dir=str(page_cache_dir),
            owner_pids=_owners(folders),
            **reclaimed.to_dict(),
        )
    elif ranges:
        _log.debug("discarded the direct extent", target=direct.name, bytes=reclaimed.direct_bytes)
    for folder in folders:
        if not folder.removed:
            _log.warning("cannot remove a dead store's folder", folder=str(folder.path))
    return reclaimed
