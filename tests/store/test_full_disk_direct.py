"""A direct write that finds the disk full: IOFailedError (ENOSPC) on that write, on both
engines, nothing leaked, and the next context served once there is room again.

The direct file lives on a small tmpfs. A first context grows it and leaves a punched run
behind (TRIM on close); a filler then takes every free block, so the next context, handed the
same run without growing the file, meets ENOSPC at its first write into the hole.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from dualblade.io_engine import IOFailedError
from dualblade.store import LayerLostError, open_store

from .conftest import MakeConfig, MountTmpfs, random_kv

pytestmark = pytest.mark.root


def _fill(folder: Path) -> Path:
    """Take every free block of the file system ``folder`` is on."""
    filler = folder / "filler"
    stat = os.statvfs(folder)
    fd = os.open(filler, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, stat.f_bavail * stat.f_frsize)
    finally:
        os.close(fd)
    return filler


@pytest.mark.anyio
@pytest.mark.parametrize("compat", ["off", "on"])
async def test_enospc_at_a_direct_write_fails_that_write_only(
    mount_tmpfs: MountTmpfs,
    make_config: MakeConfig,
    monkeypatch: pytest.MonkeyPatch,
    compat: str,
) -> None:
    monkeypatch.setenv("DUALBLADE_COMPAT", compat)
    small = mount_tmpfs("2m")
    # One context's run: 8 KPUs of 20 rows x 4 KiB = 640 KiB.
    config = make_config("direct", "aligned", direct={"path": str(small / "direct.kv")})
    k, v = random_kv(config, 20, seed=1)
    try:
        async with open_store(config, device="cpu") as store:
            assert store.stats().io_engine == ("threadpool" if compat == "on" else "io_uring")
            async with store.context() as first:
                for layer in range(first.num_layers):
                    await first.write(layer, k, v)
                run = (await first.direct_map()).region
            filler = _fill(small)
            async with store.context() as ctx:
                assert (await ctx.direct_map()).region == run  # the punched run, no growth
                with pytest.raises(IOFailedError) as caught:
                    await ctx.write(0, k, v)
                assert caught.value.errno == errno.ENOSPC
                assert caught.value.op == "write"
                with pytest.raises(LayerLostError):
                    await ctx.read(0)
            stats = store.stats()  # nothing leaked: no run, no file, no budget share
            assert stats.extents_held == 0
            assert stats.files_held == 0
            assert stats.page_cache_placed_bytes == 0
            filler.unlink()
            async with store.context() as ctx:  # room again: served
                for layer in range(ctx.num_layers):
                    await ctx.write(layer, k, v)
                got_k, got_v = await ctx.read(3)
                assert torch.equal(got_k, k)
                assert torch.equal(got_v, v)
    except IOFailedError as error:
        if error.errno == errno.EINVAL:
            pytest.skip(f"this kernel's tmpfs refuses O_DIRECT: {error}")
        raise


@pytest.mark.anyio
@pytest.mark.parametrize("compat", ["off", "on"])
async def test_enospc_at_a_claim_fails_that_context_only(
    mount_tmpfs: MountTmpfs,
    make_config: MakeConfig,
    monkeypatch: pytest.MonkeyPatch,
    compat: str,
) -> None:
    monkeypatch.setenv("DUALBLADE_COMPAT", compat)
    small = mount_tmpfs("512k")  # a 640 KiB run does not fit; a 2-row context's 64 KiB does
    config = make_config("direct", "aligned", direct={"path": str(small / "direct.kv")})
    async with open_store(config, device="cpu") as store:
        async with store.context() as ctx:
            k, v = random_kv(config, 20, seed=1)
            with pytest.raises(IOFailedError) as caught:
                await ctx.write(0, k, v)
            assert caught.value.errno == errno.ENOSPC
            assert caught.value.op == "allocate"
            assert store.stats().extents_held == 0  # the run was given back at once
        async with store.context(max_len=2) as ctx:
            k, v = random_kv(config, 2, seed=2)
            await ctx.write(1, k, v)
            got_k, _ = await ctx.read(1)
            assert torch.equal(got_k, k)
        assert store.stats().extents_held == 0
