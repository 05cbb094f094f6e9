"""A page-cache folder on a full file system: an error for the context that met it, no signal,
nothing left behind, and the next context served."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from dualblade.io_engine import IOFailedError, PageCacheFile
from dualblade.store import open_store

from .conftest import MakeConfig, MountTmpfs, random_kv

pytestmark = pytest.mark.root


@pytest.fixture
def small_fs(mount_tmpfs: MountTmpfs) -> Path:
    """A 256 KiB tmpfs (it allocates what fallocate asks, and says ENOSPC past that)."""
    return mount_tmpfs("256k")


def test_a_file_with_no_room_is_an_error_and_is_removed(small_fs: Path) -> None:
    path = small_fs / "context-1" / "L0.K"
    with pytest.raises(IOFailedError, match="no room for the file") as caught:
        PageCacheFile(path, 4 << 20)
    assert caught.value.errno == errno.ENOSPC
    assert not path.exists()


@pytest.mark.anyio
@pytest.mark.parametrize("policy", ["page-cache", "baseline"])
async def test_a_full_disk_fails_one_context_and_the_next_is_served(
    small_fs: Path, make_config: MakeConfig, policy: str
) -> None:
    # 8 files of 80 KiB do not fit in 256 KiB; a 2-row context's 8 files of 8 KiB do.
    config = make_config(policy, "aligned", prompt_len=16, max_new_tokens=4)
    data = config.model_dump()
    data["storage"]["page_cache_dir"] = str(small_fs / "pc")
    config = type(config).model_validate(data)

    async def fill(store) -> None:
        async with store.context() as ctx:
            k, v = random_kv(config, 20, seed=1)
            for layer in range(ctx.num_layers):
                await ctx.write(layer, k, v)

    async with open_store(config, device="cpu") as store:
        with pytest.raises(IOFailedError, match="no room for the file") as caught:
            await fill(store)
        assert caught.value.errno == errno.ENOSPC
        assert store.stats().files_held == 0
        async with store.context(max_len=2) as small:
            k, v = random_kv(config, 2, seed=2)
            for layer in range(small.num_layers):
                await small.write(layer, k, v)
            got_k, got_v = await small.read(3)
            assert torch.equal(got_k, k)
            assert torch.equal(got_v, v)
