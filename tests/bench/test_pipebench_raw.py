"""pipebench's raw side: every extent once, one read per buffer at a time, into memory of the
kind the pipeline's reads land in."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dualblade.bench.pipebench import _raw_buffers, _raw_pass, direct_only, prefill_random
from dualblade.bench.pipebench_device_raw import DeviceLane, device_lanes, raw_device_pass
from dualblade.io_engine import AlignedBuffer, IOEngineError, StorageSlots
from dualblade.pipeline import config_from_mapping
from dualblade.store import open_store

pytestmark = pytest.mark.anyio


def _config(tmp_path: Path):  # type: ignore[no-untyped-def]
    config = config_from_mapping(
        {
            "copy_threads": 2,
            "max_chunk": "64KiB",
            "model": {"num_layers": 4, "hidden_size": 512, "num_heads": 8, "dtype": "float16"},
            "workload": {"batch": 4, "prompt_len": 60, "max_new_tokens": 4},
            "memory": {"page_cache_budget": "1MiB"},
            "storage": {"page_cache_dir": str(tmp_path / "pc")},
        }
    )
    return direct_only(config, str(tmp_path / "d.kv"))


async def test_the_raw_side_reads_each_extent_once_two_at_a_time(tmp_path: Path) -> None:
    config = _config(tmp_path)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        await prefill_random(ctx, store)
        extents = list(await ctx.direct_map())
        chunks: list[tuple[int, int, float, float]] = []
        store.observe_chunks(
            lambda _t, op, offset, size, submitted, ended, _res: (
                chunks.append((offset, size, submitted, ended)) if op == "read" else None
            )
        )
        memory, buffers = _raw_buffers(store, ctx, 2)
        try:
            # the memory the pipeline lands in: the read buffers' own mapping
            assert [b.address for b in buffers] == [m.landings[0].buffer.address for m in memory]  # type: ignore[union-attr]
            await _raw_pass(store, ctx, buffers)
        finally:
            for read_buffers in memory:
                read_buffers.close()
        spans = []
        for extent in extents:
            mine = [
                c for c in chunks if extent.byte_offset <= c[0] < extent.byte_offset + extent.nbytes
            ]
            assert sum(c[1] for c in mine) == extent.nbytes  # every byte once
            spans.append((min(c[2] for c in mine), max(c[3] for c in mine)))
        assert len(chunks) == sum(-(-e.nbytes // (64 << 10)) for e in extents)
        # at most two extents in flight at any moment: one per buffer
        for start, _ in spans:
            assert sum(1 for s, e in spans if s <= start < e) <= 2


async def test_a_raw_read_lands_at_its_buffer_offset(tmp_path: Path) -> None:
    config = _config(tmp_path)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        await prefill_random(ctx, store)
        extent = list(await ctx.direct_map())[1]
        with AlignedBuffer(2 * extent.nbytes) as twice, AlignedBuffer(extent.nbytes) as once:
            twice.view[:] = b"\xa5" * twice.size
            await store.raw_direct_read(once, extent.nbytes, extent.byte_offset)
            await store.raw_direct_read(
                twice, extent.nbytes, extent.byte_offset, buf_offset=extent.nbytes
            )
            assert bytes(twice.view[extent.nbytes :]) == bytes(once.view[: extent.nbytes])
            assert bytes(twice.view[: extent.nbytes]) == b"\xa5" * extent.nbytes  # untouched
            with pytest.raises(IOEngineError, match="overruns"):  # refused before any I/O
                await store.raw_direct_read(
                    twice, extent.nbytes, extent.byte_offset, buf_offset=extent.nbytes + 4096
                )


async def test_the_device_raw_side_refuses_extents_larger_than_its_images(tmp_path: Path) -> None:
    config = _config(tmp_path)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        await prefill_random(ctx, store)
        extent = next(iter(await ctx.direct_map()))
        with AlignedBuffer(extent.nbytes) as buffer:
            small = 4096  # smaller than any extent: the first read would overrun the image
            lane = DeviceLane(buffer, 0, buffer.tensor(count=small), torch.empty(small), None)  # type: ignore[arg-type]  # no stream: refused before any copy
            with pytest.raises(ValueError, match="does not fit an image"):
                await raw_device_pass(store, ctx, [lane], StorageSlots(1))
            del lane


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_the_device_raw_side_copies_each_lanes_reads_to_the_device(tmp_path: Path) -> None:
    config = _config(tmp_path)
    async with open_store(config, device="cuda") as store, store.context() as ctx:
        await prefill_random(ctx, store)
        extents = list(await ctx.direct_map())
        lanes = device_lanes(store.pinned_images(), store.device)
        assert len(lanes) == store.pin_images * config.copy_threads
        await raw_device_pass(store, ctx, lanes, StorageSlots(config.copy_threads))
        # each lane holds its last read: its device tensor against a fresh read of that extent
        held = [
            (lane.device_tensor, extents[index :: len(lanes)][-1])
            for index, lane in enumerate(lanes)
        ]
        lanes.clear()  # their host tensors alias the store's pinned buffers
        for device_tensor, extent in held:
            with AlignedBuffer(extent.nbytes) as expected:
                await store.raw_direct_read(expected, extent.nbytes, extent.byte_offset)
                assert bytes(device_tensor[: extent.nbytes].cpu().numpy()) == bytes(
                    expected.view[: extent.nbytes]
                )
