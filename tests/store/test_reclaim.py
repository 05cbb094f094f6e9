"""A store that starts removes what dead predecessors left, before it serves, and says so.

The page-cache side: folders whose lock nobody holds are removed, live ones (this process's or
another's) are not. The direct side: every byte that holds data inside the configured extent is
punched, nothing outside it is touched. The crash itself (a child killed with SIGKILL) is in
test_reclaim_kill.py.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from dualblade.io_engine import DirectFile, IOEngine, Target, TargetError
from dualblade.store import open_store
from dualblade.store.reclaim import reclaim_direct
from dualblade.store.store_folder import (
    LOCK_NAME,
    UNLOCKED_GRACE_S,
    claim_store_folder,
    remove_dead_folders,
)
from dualblade.testing import FaultPolicy, FaultyTarget

from .conftest import MakeConfig, random_kv

BLOCK = 4096


def _dead_folder(page_cache_dir: Path, files: int = 2, size: int = 3 * BLOCK) -> Path:
    """A store folder as a killed store leaves it: files written, the lock no longer held."""
    folder = claim_store_folder(page_cache_dir)
    context = folder.path / "context-1"
    context.mkdir()
    for n in range(files):
        (context / f"L{n}.K").write_bytes(os.urandom(size))
    os.close(folder._lock_fd)  # the kernel drops a dead process's flock like this
    folder._lock_fd = -1
    return folder.path


def test_a_dead_stores_folder_is_removed_and_counted(tmp_path: Path) -> None:
    dead = _dead_folder(tmp_path, files=3, size=2 * BLOCK)
    found = remove_dead_folders(tmp_path)
    assert [f.path for f in found] == [dead]
    assert found[0].files == 3
    assert found[0].bytes >= 3 * 2 * BLOCK
    assert found[0].owner is not None
    assert found[0].owner["pid"] == os.getpid()
    assert found[0].removed
    assert not dead.exists()


def test_live_folders_are_left_alone(tmp_path: Path) -> None:
    live = claim_store_folder(tmp_path)
    (live.path / "context-1").mkdir()
    try:
        assert remove_dead_folders(tmp_path) == []
        assert (live.path / "context-1").is_dir()
        # A lock held by another process's open file description counts just the same.
        fd = os.open(live.path / LOCK_NAME, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        live.close()
    assert not live.path.exists()


def test_a_folder_without_lock_is_dead_only_once_it_is_old(tmp_path: Path) -> None:
    legacy = tmp_path / "store-7f00aa"  # what a dualblade from before the lock left
    (legacy / "context-3").mkdir(parents=True)
    (legacy / "context-3" / "L0.V").write_bytes(b"x" * BLOCK)
    assert remove_dead_folders(tmp_path) == []  # it may be a store starting right now
    old = time.time() - UNLOCKED_GRACE_S - 5
    os.utime(legacy, (old, old))
    [found] = remove_dead_folders(tmp_path)
    assert found.owner is None
    assert found.files == 1
    assert not legacy.exists()


def test_only_store_folders_are_looked_at_and_links_never_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("user data")
    pc = tmp_path / "pc"
    pc.mkdir()
    (pc / "store-link").symlink_to(elsewhere)
    (pc / "notes").mkdir()
    old = time.time() - UNLOCKED_GRACE_S - 5
    os.utime(pc / "notes", (old, old))
    assert remove_dead_folders(pc) == []
    assert (elsewhere / "keep").read_text() == "user data"
    assert (pc / "notes").is_dir()


def test_store_folders_are_owner_only(tmp_path: Path) -> None:
    folder = claim_store_folder(tmp_path / "pc")
    try:
        assert folder.path.name.startswith(f"store-{os.getpid()}-")
        assert folder.path.stat().st_mode & 0o777 == 0o700
        assert (folder.path / LOCK_NAME).stat().st_mode & 0o777 == 0o600
    finally:
        folder.close()


def _data(target: DirectFile, start: int, end: int) -> list[tuple[int, int]]:
    return target.allocated_ranges(start, end - start)


@pytest.mark.anyio
async def test_only_data_inside_the_extent_is_punched(tmp_path: Path) -> None:
    # Blocks [0, 4) precede the extent, [4, 20) are the extent, [20, 24) follow it.
    target = DirectFile(tmp_path / "direct.kv", 24 * BLOCK)
    try:
        with open(tmp_path / "direct.kv", "r+b") as file:  # buffered: any buffer will do
            for block in (1, 5, 6, 12, 19, 21):
                os.pwrite(file.fileno(), bytes([block]) * BLOCK, block * BLOCK)
        assert _data(target, 4 * BLOCK, 20 * BLOCK) == [
            (5 * BLOCK, 2 * BLOCK),
            (12 * BLOCK, BLOCK),
            (19 * BLOCK, BLOCK),
        ]
        with IOEngine(queue_depth=4) as engine:
            ranges, exact = await reclaim_direct(engine, target, 4, 16)
        assert exact
        assert sum(n for _, n in ranges) == 4 * BLOCK
        assert _data(target, 4 * BLOCK, 20 * BLOCK) == []
        # Outside the extent: untouched.
        assert _data(target, 0, 4 * BLOCK) == [(BLOCK, BLOCK)]
        assert _data(target, 20 * BLOCK, 24 * BLOCK) == [(21 * BLOCK, BLOCK)]
        with open(tmp_path / "direct.kv", "rb") as file:
            assert os.pread(file.fileno(), BLOCK, 21 * BLOCK) == bytes([21]) * BLOCK
    finally:
        target.close()


@pytest.mark.anyio
@pytest.mark.parametrize("compat", ["off", "on"])
async def test_a_store_reclaims_before_it_serves_and_logs_it(
    tmp_path: Path, make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch, compat: str
) -> None:
    monkeypatch.setenv("DUALBLADE_COMPAT", compat)
    config = make_config("dual", "aligned")
    dead = _dead_folder(tmp_path / "pc", files=2, size=BLOCK)
    # A predecessor's direct bytes: the growable file holds 64 blocks of KV.
    DirectFile(tmp_path / "direct.kv", 64 * BLOCK).close()
    with open(tmp_path / "direct.kv", "r+b") as file:
        file.write(b"\x5a" * 64 * BLOCK)
    with capture_logs() as logs:
        async with open_store(config, device="cpu") as store:
            reclaimed = store.runtime.reclaimed
            assert not dead.exists()
            assert (reclaimed.store_folders, reclaimed.files) == (1, 2)
            assert reclaimed.file_bytes >= 2 * BLOCK
            assert (reclaimed.direct_extents, reclaimed.direct_bytes) == (1, 64 * BLOCK)
            assert reclaimed.direct_exact
            assert reclaimed.left_behind == 0
            with open(tmp_path / "direct.kv", "rb") as file:
                assert file.read() == bytes(64 * BLOCK)  # holes read as zeros
            async with store.context() as ctx:
                k, v = random_kv(config, 4, seed=3)
                await ctx.write(3, k, v)
                got_k, _ = await ctx.read(3)
                assert got_k.equal(k)
    [event] = [e for e in logs if e["event"] == "reclaimed what dead stores left"]
    assert event["log_level"] == "info"
    assert event["owner_pids"] == [os.getpid()]
    assert event["direct_bytes"] == 64 * BLOCK
    assert event["files"] == 2
    # The store's own folder went with it.
    assert list((tmp_path / "pc").iterdir()) == []


@pytest.mark.anyio
async def test_a_clean_predecessor_leaves_nothing_to_reclaim(
    tmp_path: Path, make_config: MakeConfig
) -> None:
    config = make_config("dual", "aligned")
    for _ in range(2):
        async with open_store(config, device="cpu") as store:
            async with store.context() as ctx:
                k, v = random_kv(config, 8, seed=1)
                for layer in range(ctx.num_layers):
                    await ctx.write(layer, k, v)
            reclaimed = store.runtime.reclaimed
    assert reclaimed.bytes == 0
    assert reclaimed.store_folders == 0


class _Device(FaultyTarget):
    """A direct file that answers like a device: it cannot say which blocks hold data."""

    def allocated_ranges(self, offset: int, length: int) -> list[tuple[int, int]] | None:
        return None


@pytest.mark.anyio
async def test_a_device_has_its_whole_extent_discarded_and_no_more(tmp_path: Path) -> None:
    target = _Device(DirectFile(tmp_path / "direct.kv", 24 * BLOCK), FaultPolicy(0.0))
    try:
        with open(tmp_path / "direct.kv", "r+b") as file:
            file.write(b"\x5a" * 24 * BLOCK)
        with IOEngine(queue_depth=4) as engine:
            ranges, exact = await reclaim_direct(engine, target, 4, 16)
        assert ranges == [(4 * BLOCK, 16 * BLOCK)]
        assert not exact
        data = target.inner.allocated_ranges(0, 24 * BLOCK)
        assert data == [(0, 4 * BLOCK), (20 * BLOCK, 4 * BLOCK)]
    finally:
        target.close()


@pytest.mark.anyio
async def test_a_target_that_cannot_discard_still_starts_and_says_so(
    tmp_path: Path, make_config: MakeConfig
) -> None:
    config = make_config("direct", "aligned")

    def no_discard(target: Target) -> Target:
        wrapped = _Device(target, FaultPolicy(0.0))

        def refuse(offset: int, length: int) -> None:
            raise TargetError(f"{target.name} does not support discard (TRIM)")

        wrapped.trim_op = lambda offset, length: None  # type: ignore[method-assign]
        wrapped.trim_blocking = refuse  # type: ignore[method-assign]
        return wrapped

    DirectFile(tmp_path / "direct.kv", 8 * BLOCK).close()
    with capture_logs() as logs:
        async with open_store(config, device="cpu", wrap_direct=no_discard) as store:
            assert store.runtime.reclaimed.left_behind == 1
            assert store.runtime.reclaimed.direct_bytes == 0
    [warning] = [e for e in logs if e["log_level"] == "warning"]
    assert "never served" in warning["event"]
