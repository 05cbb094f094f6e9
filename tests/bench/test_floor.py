"""The run's own floor: its arithmetic, and its passes over a real store's storage."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from dualblade.bench import page_cache_limit
from dualblade.bench.floor import (
    DecodeReads,
    FloorRates,
    PassTime,
    _copy_through_map,
    _to_device_pass,
    decode_floor,
    measure_floor_rates,
    page_cache_reads,
)
from dualblade.bench.page_cache_limit import thread_counts
from dualblade.bench.sweep_workload import derive_kv, read_buffers, run_sweep_workload
from dualblade.io_engine import AlignedBuffer, BufferWindow, PageCacheFile
from dualblade.pipeline import PipelineConfig, config_from_mapping, pin_bytes
from dualblade.store import KVContext, open_store

GB = 1_000_000_000


def _rate(bytes_per_s: float) -> PassTime:
    return PassTime(int(bytes_per_s), (1.5, 1.0, 1.2))  # the fastest repetition counts


def test_the_floor_is_the_larger_path_and_the_serial_sum_is_beside_it() -> None:
    reads = DecodeReads(direct=4 * GB, page_cache=6 * GB, resident=5 * GB)
    rates = FloorRates(direct=_rate(2 * GB), resident=_rate(10 * GB))
    floor = decode_floor(reads, rates)
    # disk: 4 GB direct + 1 GB of misses at the direct extents' 2 GB/s; memory: 5 GB at 10 GB/s
    assert floor["floor"]["disk_s"] == pytest.approx(2.5)
    assert floor["floor"]["memory_s"] == pytest.approx(0.5)
    assert floor["floor_s"] == pytest.approx(2.5)
    assert floor["floor_serial_s"] == pytest.approx(3.0)


def test_misses_of_a_run_without_direct_extents_are_priced_at_its_files_disk_rate() -> None:
    reads = DecodeReads(direct=0, page_cache=3 * GB, resident=0)
    floor = decode_floor(reads, FloorRates(file_disk=_rate(1 * GB)))
    assert floor["floor_s"] == pytest.approx(3.0)
    assert floor["floor"]["memory_s"] == 0.0


def test_a_disk_source_that_was_read_but_not_measured_leaves_no_floor() -> None:
    reads = DecodeReads(direct=1 * GB, page_cache=0, resident=0)
    floor = decode_floor(reads, FloorRates(resident=_rate(1 * GB)))
    assert floor["floor_s"] is None
    assert "direct extents" in floor["floor_error"]


def test_untimed_hits_leave_the_disk_part_alone_as_a_looser_floor() -> None:
    reads = DecodeReads(direct=1 * GB, page_cache=1 * GB, resident=1 * GB)
    floor = decode_floor(reads, FloorRates(direct=_rate(1 * GB)))
    assert floor["floor_s"] == pytest.approx(1.0)
    assert "memory part counts as 0" in floor["floor"]["note"]


def test_misses_are_priced_at_the_faster_disk_rate() -> None:
    # buffered cold reads can beat O_DIRECT on a VM: the floor takes the faster
    reads = DecodeReads(direct=2 * GB, page_cache=2 * GB, resident=0)
    rates = FloorRates(direct=_rate(1 * GB), file_disk=_rate(2 * GB))
    assert decode_floor(reads, rates)["floor"]["disk_s"] == pytest.approx(2.0 + 1.0)


def test_on_a_gpu_the_hits_are_priced_at_their_move_to_the_device() -> None:
    """The host copy out of the page cache alone is faster than the whole move: a CUDA run's
    hits are priced at the move, and the report says so."""
    reads = DecodeReads(direct=1 * GB, page_cache=6 * GB, resident=6 * GB)
    rates = FloorRates(direct=_rate(2 * GB), resident=_rate(60 * GB), to_device=_rate(30 * GB))
    floor = decode_floor(reads, rates)
    assert floor["floor"]["memory_s"] == pytest.approx(0.2)
    assert floor["floor_s"] == pytest.approx(0.5)  # the disk part, 1 GB at 2 GB/s, is larger
    assert floor["floor"]["memory_part"] == "hits moved to the device"
    assert floor["floor"]["passes"]["to_device"]["bytes_per_s"] == 30 * GB


@pytest.mark.anyio
async def test_the_move_to_the_device_times_every_resident_byte(tmp_path: Path) -> None:
    """The pass moves each resident file's bytes (here to host memory, the CPU fallback) once
    per repetition, in pieces of the buffer it is given."""
    sizes = [3 * 4096 + 512, 5 * 4096]
    files = [PageCacheFile(tmp_path / f"f{i}.kv", 8 * 4096) for i in range(2)]
    try:
        for file, nbytes in zip(files, sizes, strict=True):
            os.pwrite(file.fd, os.urandom(nbytes), 0)
        with AlignedBuffer(64 * 4096, huge=False) as memory:
            moved = await _to_device_pass(
                list(zip(files, sizes, strict=True)),
                torch.device("cpu"),
                [BufferWindow.whole(memory)],
                repeats=2,
            )
        assert moved.nbytes == sum(sizes)
        assert len(moved.seconds) == 2
        assert all(seconds > 0 for seconds in moved.seconds)
        # every thread count tried is reported, and the pass's rate is the best of them
        threads = [n for n, _ in moved.by_threads]
        assert threads == list(thread_counts())
        assert moved.rate == pytest.approx(max(rate for _, rate in moved.by_threads))
        reported = moved.to_dict()["bytes_per_s_by_threads"]
        assert set(reported) == {str(n) for n in threads}
    finally:
        for file in files:
            file.close()


def _config(tmp_path: Path, policy: str) -> PipelineConfig:
    return config_from_mapping(
        {
            "model": {"num_layers": 4, "hidden_size": 512, "num_heads": 8, "dtype": "float16"},
            "workload": {"batch": 4, "prompt_len": 60, "max_new_tokens": 4},
            # a layer's K and V take 2 x 64 rows x 4 KiB: two of the four layers in 1 MiB
            "memory": {"page_cache_budget": "1MiB", "knob_x": "1MiB"},
            "storage": {
                "direct": {"path": str(tmp_path / "direct.kv")},
                "page_cache_dir": str(tmp_path / "pc"),
            },
            "policy": policy,
            "copy_threads": 2,
        },
        source="test",
        env={},
    )


async def _rates_after_a_decode(
    config: PipelineConfig, *, refuse_engine_reads: bool = False
) -> FloorRates:
    """A 3-step decode of ``config``'s workload, then its floor's passes (two repetitions);
    ``refuse_engine_reads``: the passes fail if they read through the store's engine."""
    buffers = read_buffers(config, "cpu")
    memory = [b.landings[0].buffer for b in buffers if b.landings[0] is not None]
    seen: list[FloorRates] = []

    async def refuse(*args: object, **kwargs: object) -> int:
        raise AssertionError("the floor read through the engine")

    async with open_store(config, device="cpu") as store:

        async def after_decode(ctx: KVContext) -> None:
            engine_read = ctx.engine.pread
            if refuse_engine_reads:
                ctx.engine.pread = refuse  # type: ignore[method-assign]
            try:
                seen.append(await measure_floor_rates(store, ctx, memory, repeats=2))
            finally:
                ctx.engine.pread = engine_read  # type: ignore[method-assign]

        await run_sweep_workload(
            store,
            decode_steps=3,
            data=derive_kv(config, 0),
            buffers=buffers,
            after_decode=after_decode,
        )
    (rates,) = seen
    return rates


@pytest.mark.anyio
@pytest.mark.parametrize("policy", ["dual", "direct", "page-cache", "cache-policy"])
async def test_the_passes_read_the_runs_own_storage(tmp_path: Path, policy: str) -> None:
    rates = await _rates_after_a_decode(_config(tmp_path, policy))
    row = 4 * 512 * 2  # batch 4 x 512 halfs
    direct_layers = {"dual": 2, "direct": 4}.get(policy, 0)
    kpu = 63 * row  # the rows the decode had written at its end: 60 + 3
    if direct_layers:
        assert rates.direct is not None
        assert rates.direct.nbytes == direct_layers * 2 * kpu
        assert len(rates.direct.seconds) == 2
    else:
        assert rates.direct is None
    if policy == "cache-policy":  # layers 1 and 3 are dropped after each use: cold
        assert rates.file_disk is not None
        assert rates.file_disk.nbytes == 2 * 2 * kpu
    else:  # nothing the decode read from the page cache has left it
        assert rates.file_disk is None
    assert rates.to_device is None  # a host run: its hits end in host memory
    if policy in ("dual", "page-cache", "cache-policy"):
        # the layers kept resident (cache-policy drops the ones beyond its budget)
        assert rates.resident is not None
        assert rates.resident.nbytes == {"page-cache": 4}.get(policy, 2) * 2 * kpu
    else:
        assert rates.resident is None


@pytest.mark.anyio
async def test_the_move_to_the_device_borrows_the_stores_pinned_images(
    tmp_path: Path, monkeypatch
) -> None:
    """On a GPU the to-device pass carves its pieces from the copy threads' KPU images (no
    memory of its own inside the run's limit): here, through the CPU fallback, every resident
    byte moves through them and nothing is allocated."""
    config = _config(tmp_path, "page-cache")
    buffers = read_buffers(config, "cpu")
    moved: list[PassTime] = []

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the pass allocated host memory of its own")

    async with open_store(config, device="cpu") as store:

        async def after_decode(ctx: KVContext) -> None:
            windows = store.pinned_images()
            image = pin_bytes(config)
            assert [(w.buffer, w.offset, w.nbytes) for w in windows] == [
                (buffer, index * image, image)
                for buffer in store.pinned_buffers()
                for index in range(store.pin_images)
            ]
            resident = [(file, n) for file, n in await page_cache_reads(ctx) if n > 0]
            monkeypatch.setattr(page_cache_limit, "AlignedBuffer", refuse)
            moved.append(await _to_device_pass(resident, store.device, windows, 1))
            monkeypatch.undo()

        await run_sweep_workload(
            store,
            decode_steps=2,
            data=derive_kv(config, 0),
            buffers=buffers,
            after_decode=after_decode,
        )
    (move,) = moved
    assert move.nbytes == 4 * 2 * 62 * 4 * 512 * 2  # 4 layers' K and V, 60 + 2 rows each


@pytest.mark.anyio
async def test_the_baselines_file_passes_copy_through_its_map(tmp_path: Path) -> None:
    """The baseline reads its files through a memory map, so its floor does too: read through
    the engine, its misses were timed in another I/O shape and the floor was beaten."""
    rates = await _rates_after_a_decode(_config(tmp_path, "baseline"), refuse_engine_reads=True)
    assert rates.direct is None
    assert rates.file_disk is None  # nothing left the page cache without a limit
    assert rates.resident is not None
    assert rates.resident.nbytes == 4 * 2 * 63 * (4 * 512 * 2)


def test_a_copy_through_the_map_moves_the_files_bytes(tmp_path: Path) -> None:
    payload = os.urandom(3 * 4096 + 100)
    with (
        PageCacheFile(tmp_path / "f.kv", 4 * 4096) as file,
        AlignedBuffer(4 * 4096, huge=False) as buffer,
    ):
        os.pwrite(file.fd, payload, 0)
        _copy_through_map(file, buffer, len(payload))
        assert (
            hashlib.sha256(buffer.view[: len(payload)]).digest() == hashlib.sha256(payload).digest()
        )
        assert bytes(buffer.view[len(payload) :]) == bytes(4 * 4096 - len(payload))
