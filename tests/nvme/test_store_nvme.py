"""The KVStore ``direct`` policy end to end on an NVMe namespace (passthrough READ/WRITE/DSM).

A prefill is written, decode steps read the layer back and append a row, every read is compared
byte for byte; when the context closes its run of blocks must be deallocated (Dataset
Management): the binder counts the blocks trimmed and the namespace reads them back as zeros.

Its own module because it imports torch (~40 s in the TCG guest; the io_engine-level tests in
``test_passthrough.py`` do without).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dualblade.actors import Reply
from dualblade.actors.binder import Book, GetBook
from dualblade.io_engine import AlignedBuffer, NvmeNamespace
from dualblade.pipeline.config import PipelineConfig
from dualblade.store import KVStore, open_store

pytestmark = pytest.mark.anyio

MiB = 1 << 20
LAYERS, BATCH, HEADS, HEAD_DIM = 2, 2, 4, 96  # rows of 1536 bytes: padded on 4 KiB LBAs
PROMPT, NEW = 400, 3
#: Far from the slots test_passthrough.py writes (the first 832 MiB).
REGION_START, REGION_SIZE = 896 * MiB, 64 * MiB


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def store_config(path: Path, lba_size: int, page_cache_dir: Path) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            "model": {
                "num_layers": LAYERS,
                "hidden_size": HEADS * HEAD_DIM,
                "num_heads": HEADS,
                "dtype": "float16",
            },
            "workload": {"batch": BATCH, "prompt_len": PROMPT, "max_new_tokens": NEW},
            "storage": {
                "page_cache_dir": str(page_cache_dir),
                "direct": {
                    "kind": "nvme",
                    "path": str(path),
                    "first_lba": REGION_START // lba_size,
                    "extent_size": REGION_SIZE,
                    "lba_size": lba_size,
                },
            },
            "memory": {"page_cache_budget": 0},
            "policy": "direct",
            "copy_threads": 2,
            "queue_depth": 8,
        }
    )


async def raw_extent(store: KVStore, first_lba: int, n_blocks: int) -> bytes:
    """The extent's bytes as the namespace holds them, read past the store's own path."""
    runtime = store.runtime
    lba = runtime.direct.lba_size
    with AlignedBuffer(n_blocks * lba) as buf:
        await runtime.engine.pread(runtime.direct, buf, n_blocks * lba, first_lba * lba)
        return bytes(buf.view[: n_blocks * lba])


async def book(store: KVStore) -> Book:
    reply: Reply[Book] = Reply()
    return await store.runtime.binder.ask(GetBook(reply), reply)


@pytest.mark.timeout(300)
async def test_direct_policy_round_trips_and_deallocates(
    nvme_namespace_path: Path, tmp_path: Path
) -> None:
    with NvmeNamespace(str(nvme_namespace_path)) as probe:
        lba_size = probe.lba_size
        max_transfer = probe.max_transfer
    config = store_config(nvme_namespace_path, lba_size, tmp_path / "page-cache")
    generator = torch.Generator().manual_seed(lba_size)

    def rows(n: int) -> torch.Tensor:
        return torch.randn((n, BATCH, HEADS * HEAD_DIM), generator=generator).half()

    async with open_store(config, device="cpu") as store:
        assert isinstance(store.runtime.direct, NvmeNamespace)
        assert store.runtime.engine.passthrough
        assert list(store.plan.placement.direct) == list(range(LAYERS))
        layout = store.plan.layout
        # A KPU's image takes several commands at this namespace's max transfer.
        assert layout.image_bytes > max_transfer
        trimmed_before = store.runtime.binder.trimmed_blocks
        chunks_before = store.runtime.engine.chunks_submitted

        async with store.context() as ctx:
            expected: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for layer in range(LAYERS):
                k, v = rows(PROMPT), rows(PROMPT)
                await ctx.write(layer, k, v)
                expected[layer] = (k, v)
            for _step in range(NEW):
                for layer in range(LAYERS):
                    k_read, v_read = await ctx.read(layer)
                    k_want, v_want = expected[layer]
                    assert k_read.device.type == "cpu"
                    assert torch.equal(k_read, k_want)
                    assert torch.equal(v_read, v_want)
                    k_row, v_row = rows(1), rows(1)
                    length = await ctx.append(layer, k_row[0], v_row[0])
                    expected[layer] = (torch.cat([k_want, k_row]), torch.cat([v_want, v_row]))
                    assert length == expected[layer][0].shape[0]
            for layer in range(LAYERS):
                k_read, v_read = await ctx.read(layer)
                assert torch.equal(k_read, expected[layer][0])
                assert torch.equal(v_read, expected[layer][1])
                # A middle slice, as a decode step with a window would read it.
                k_mid, _ = await ctx.read(layer, (7, PROMPT + 1))
                assert torch.equal(k_mid, expected[layer][0][7 : PROMPT + 1])
            assert store.runtime.engine.chunks_submitted > chunks_before

            # The bytes really are on the namespace, inside the configured region.
            held = await book(store)
            first_lba, n_blocks = held.extents[ctx.id]
            assert REGION_START // lba_size <= first_lba
            assert (first_lba + n_blocks) * lba_size <= REGION_START + REGION_SIZE
            assert n_blocks * lba_size == 2 * LAYERS * layout.image_bytes
            image = await raw_extent(store, first_lba, n_blocks)
            for k, v in expected.values():
                for tensor in (k, v):
                    row0 = tensor[0].contiguous().view(torch.uint8).numpy().tobytes()
                    at = image.find(row0)
                    assert at >= 0
                    assert at % lba_size == 0

        # Closing the context deallocated its run: counted, and zeros on the namespace.
        assert store.runtime.binder.trimmed_blocks == trimmed_before + n_blocks
        assert ctx.id not in (await book(store)).extents
        assert await raw_extent(store, first_lba, n_blocks) == bytes(n_blocks * lba_size)
