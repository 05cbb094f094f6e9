"""Write-back errors of page-cache files: checked before pages are dropped, and raised to the
context that owns the file as the typed error of its operation.

The cache-policy path drops a layer's pages after each write (``DONTNEED``); a page the kernel
failed to write back is marked clean anyway, so dropping it would let a later read return the
stale bytes underneath. The write-back's result is checked first, and a failure fails the write.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from dualblade.io_engine import IOFailedError, PageCacheFile
from dualblade.store import LayerLostError, open_store
from dualblade.testing import (
    FaultKind,
    FaultLog,
    FaultPolicy,
    FaultyPageCacheFile,
    InjectedIOError,
)

from .conftest import MakeConfig, random_kv


def test_a_failed_fdatasync_is_a_typed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = PageCacheFile(tmp_path / "L0.K", 8192)

    def fails(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    try:
        monkeypatch.setattr(os, "fdatasync", fails)
        with pytest.raises(IOFailedError, match="write-back") as caught:
            file.evict()
        assert caught.value.errno == errno.EIO
        assert caught.value.op == "write-back"
    finally:
        file.close()


def test_range_write_back_and_check_pass_on_a_healthy_file(tmp_path: Path) -> None:
    with PageCacheFile(tmp_path / "L0.K", 1 << 20) as file:
        os.pwrite(file.fd, b"x" * 8192, 4096)
        file.write_back(0, 1 << 20)
        file.check_write_back()
        file.drop(0, 0)
        assert os.pread(file.fd, 8192, 4096) == b"x" * 8192


class _Recording(FaultyPageCacheFile):
    """Records which of its ranges were dropped, to show none was after a failed write-back."""

    dropped: ClassVar[list[str]] = []

    def advise_dontneed(self, offset: int = 0, length: int = 0) -> None:
        _Recording.dropped.append(self.name)
        super().advise_dontneed(offset, length)


@pytest.mark.anyio
@pytest.mark.parametrize("compat", ["off", "on"])
async def test_a_failed_write_back_fails_the_write_and_keeps_the_pages(
    make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch, compat: str
) -> None:
    monkeypatch.setenv("DUALBLADE_COMPAT", compat)
    config = make_config("cache-policy", "aligned")  # layers 1 and 3 are dropped after use
    policy = FaultPolicy(1.0, kinds=(FaultKind.EIO,), ops=("write-back",))
    log = FaultLog()
    _Recording.dropped = []

    def page_cache_file(path: Path, size: int) -> FaultyPageCacheFile:
        return _Recording(path, size, policy, log)

    async with open_store(config, device="cpu", page_cache_file=page_cache_file) as store:
        assert store.stats().io_engine == ("threadpool" if compat == "on" else "io_uring")
        async with store.context() as ctx:
            k, v = random_kv(config, 10, seed=1)
            await ctx.write(0, k, v)  # a cached layer: not written back, not dropped
            with pytest.raises(InjectedIOError) as caught:
                await ctx.write(1, k, v)
            assert caught.value.op == "write-back"
            assert caught.value.errno == errno.EIO
            assert caught.value.serial in {fault.serial for fault in log.injected}
            assert _Recording.dropped == [], "pages dropped although write-back failed"
            with pytest.raises(LayerLostError):
                await ctx.read(1)
            got_k, _ = await ctx.read(0)
            assert torch.equal(got_k, k)
            policy.enabled = False  # the disk recovers: the layer can be written again
            await ctx.write(1, k, v)
            got_k, got_v = await ctx.read(1)
            assert torch.equal(got_k, k)
            assert torch.equal(got_v, v)
            assert _Recording.dropped, "a healthy write-back drops the pages as before"
        assert store.stats().files_held == 0
        async with store.context() as ctx:  # the next context is served
            await ctx.write(3, k, v)
            got_k, _ = await ctx.read(3)
            assert torch.equal(got_k, k)


class _Starts(FaultyPageCacheFile):
    """Records the ranges whose write-back was started."""

    started: ClassVar[list[tuple[str, int, int]]] = []

    def start_write_back(self, offset: int, length: int) -> None:
        _Starts.started.append((self.name, offset, length))
        super().start_write_back(offset, length)


def test_start_write_back_leaves_the_pages_cached(tmp_path: Path) -> None:
    with PageCacheFile(tmp_path / "L0.K", 1 << 20) as file:
        os.pwrite(file.fd, b"y" * (256 << 10), 0)
        file.start_write_back(0, 256 << 10)
        file.check_write_back()
        assert file.resident_bytes(0, 256 << 10) == 256 << 10
        assert os.pread(file.fd, 8192, 4096) == b"y" * 8192


@pytest.mark.anyio
async def test_a_layer_written_through_the_page_cache_starts_its_write_back(
    make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill's layer starts the write-back of what it wrote (so the first decode steps do
    not wait for it); an appended row does not; a write-back that cannot start fails the write
    like any other write-back error, and the layer is lost until written again."""
    from dualblade.actors import spans

    config = make_config("dual", "aligned")  # layers 0 and 2 in the page cache
    policy = FaultPolicy(1.0, kinds=(FaultKind.EIO,), ops=("write-back",))
    policy.enabled = False
    log = FaultLog()
    _Starts.started = []
    rows = 10
    async with (
        open_store(
            config, device="cpu", page_cache_file=lambda p, n: _Starts(p, n, policy, log)
        ) as store,
        store.context() as ctx,
    ):
        stride = ctx.file_layout.row_stride
        monkeypatch.setattr(spans, "START_WRITE_BACK_BYTES", 2 * stride)  # above one row
        k, v = random_kv(config, rows, seed=2)
        await ctx.write(0, k, v)
        # K's and V's file, each from its first row to the last written
        assert len({name for name, _, _ in _Starts.started}) == 2
        assert {(o, n) for _, o, n in _Starts.started} == {(0, rows * stride)}
        await ctx.write(1, k, v)  # a direct layer: no page-cache file
        assert len(_Starts.started) == 2
        row_k, row_v = random_kv(config, 1, seed=3)
        await ctx.append(0, row_k, row_v)
        assert len(_Starts.started) == 2, "an appended row started a write-back"
        policy.enabled = True
        with pytest.raises(InjectedIOError) as caught:
            await ctx.write(2, k, v)
        assert caught.value.op == "write-back"
        with pytest.raises(LayerLostError):
            await ctx.read(2)
        policy.enabled = False
        await ctx.write(2, k, v)
        got_k, got_v = await ctx.read(2)
        assert torch.equal(got_k, k)
        assert torch.equal(got_v, v)
