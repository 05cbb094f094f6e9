"""Direct-file targets: an extent that starts past block 0, and the block size a file can move."""

from __future__ import annotations

import os

import pytest
import torch

from dualblade.errors import ConfigError
from dualblade.store import open_store

from .conftest import random_kv

pytestmark = pytest.mark.anyio


async def test_extent_after_first_lba_fits_in_the_file(make_config):
    config = make_config("direct", direct={"first_lba": 8, "extent_size": "1MiB"})
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        k, v = random_kv(config, 16, seed=3)
        await ctx.write(2, k, v)
        got_k, got_v = await ctx.read(2)
        assert torch.equal(got_k, k)
        assert torch.equal(got_v, v)
        assert store.runtime.binder.allocator.first == 8
        assert store.runtime.binder.allocator.end == 8 + 256
    assert os.path.getsize(config.storage.direct.path) >= (8 + 256) * 4096


async def test_file_target_refuses_blocks_other_than_4096(make_config):
    config = make_config("direct", direct={"lba_size": 512})
    with pytest.raises(ConfigError, match="set lba_size = 4096"):
        async with open_store(config, device="cpu"):
            pytest.fail("the store must not open")
