"""Device safety at the store: a second store on a target in use is refused, and so is an extent
that runs past the end of a block device. (Mounted file systems and partitions in use are
refused by :class:`BlockDevice` itself: tests/io_engine/test_block_device.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dualblade.io_engine import TargetError
from dualblade.store import open_store

from .conftest import MakeConfig, random_kv

pytestmark = pytest.mark.anyio


async def test_a_second_store_on_the_same_target_is_refused(make_config: MakeConfig) -> None:
    config = make_config("direct")
    async with open_store(config, device="cpu") as first, first.context() as ctx:
        k, v = random_kv(config, 16, seed=1)
        await ctx.write(0, k, v)
        with pytest.raises(TargetError, match="in use by another dualblade store"):
            async with open_store(config, device="cpu"):
                pytest.fail("two stores must not share a direct target")
        # The refused store touched nothing of the first one's.
        got, _ = await ctx.read(0)
        assert torch.equal(got, k)
    async with open_store(config, device="cpu") as again, again.context() as ctx:
        await ctx.write(0, k, v)  # free again once the first store closed


@pytest.fixture
def small_loop_device(tmp_path: Path) -> Iterator[str]:
    """An 8 MiB loop device (root only), detached afterwards."""
    if os.geteuid() != 0 or shutil.which("losetup") is None:
        pytest.skip("loop devices need root and losetup")
    backing = tmp_path / "loop.img"
    with open(backing, "wb") as f:
        f.truncate(8 << 20)
    result = subprocess.run(
        ["losetup", "--find", "--show", str(backing)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        pytest.skip(f"cannot attach a loop device here: {result.stderr.strip()}")
    device = result.stdout.strip()
    try:
        yield device
    finally:
        subprocess.run(["losetup", "-d", device], check=False)


@pytest.mark.root
@pytest.mark.parametrize(
    ("first_lba", "extent"),
    [(0, "16MiB"), (1024, "8MiB"), (16380, "8KiB")],
)
async def test_an_extent_past_the_end_of_the_device_is_refused(
    make_config: MakeConfig, small_loop_device: str, first_lba: int, extent: str
) -> None:
    config = make_config(
        "direct",
        direct={
            "kind": "block",
            "path": small_loop_device,
            "first_lba": first_lba,
            "extent_size": extent,
            "lba_size": 512,
        },
        max_chunk="64KiB",
    )
    with pytest.raises(TargetError, match="runs past the end"):
        async with open_store(config, device="cpu"):
            pytest.fail("an extent past the device's end must be refused")


@pytest.mark.root
async def test_an_extent_that_fits_the_device_works(
    make_config: MakeConfig, small_loop_device: str
) -> None:
    config = make_config(
        "direct",
        direct={
            "kind": "block",
            "path": small_loop_device,
            "first_lba": 4096,
            "extent_size": "6MiB",
            "lba_size": 512,
        },
    )
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        k, v = random_kv(config, 16, seed=3)
        await ctx.write(1, k, v)
        got, _ = await ctx.read(1)
        assert torch.equal(got, k)
