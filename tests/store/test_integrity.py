"""Randomized integrity: random shapes, policies, engines, backends and concurrency; every tensor
read back has the SHA-256 of what was stored (zero mismatches).

Hypothesis draws the whole setup: a model shape (odd batches, GQA, head sizes whose rows do
not fill a 4 KiB block, three dtypes), a policy, a chunk size, the io_uring or the thread-pool
engine, the asyncio or trio backend, how many contexts run at once, and per context a random
prefill, appends and partial reads.
"""

from __future__ import annotations

import hashlib
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dualblade.pipeline import PipelineConfig, config_from_mapping
from dualblade.pipeline.planner import layer_page_cache_bytes
from dualblade.store import KVContext, open_store

from .conftest import POLICIES


@dataclass(frozen=True)
class Setup:
    layers: int
    batch: int
    kv_heads: int
    group: int  # query heads per KV head (GQA when > 1)
    head_dim: int
    dtype: str
    max_chunk_blocks: int
    compat: str
    backend: str
    contexts: int
    prompt: int
    new_tokens: int
    seed: int


setups = st.builds(
    Setup,
    layers=st.integers(1, 3),
    batch=st.integers(1, 5),
    kv_heads=st.integers(1, 4),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([8, 24, 64, 80, 128, 256]),
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    max_chunk_blocks=st.sampled_from([1, 3, 16, 256]),
    compat=st.sampled_from(["off", "on"]),
    backend=st.sampled_from(["asyncio", "trio"]),
    contexts=st.integers(1, 4),
    prompt=st.integers(1, 40),
    new_tokens=st.integers(0, 6),
    seed=st.integers(0, 2**16),
)


def _config(setup: Setup, policy: str, folder: Path) -> PipelineConfig:
    heads = setup.kv_heads * setup.group
    data: dict[str, Any] = {
        "model": {
            "num_layers": setup.layers,
            "hidden_size": heads * setup.head_dim,
            "num_heads": heads,
            "num_kv_heads": setup.kv_heads,
            "dtype": setup.dtype,
        },
        "workload": {
            "batch": setup.batch,
            "prompt_len": setup.prompt,
            "max_new_tokens": setup.new_tokens,
        },
        "memory": {"page_cache_budget": "64MiB"},
        "storage": {"direct": {"path": str(folder / "d.kv")}, "page_cache_dir": str(folder)},
        "policy": policy,
        "max_chunk": setup.max_chunk_blocks * 4096,
    }
    config = config_from_mapping(data, env={})
    if policy in ("dual", "cache-policy"):  # half the layers on each path
        half = sum(layer_page_cache_bytes(config)[: setup.layers // 2])
        data["memory"] = {"page_cache_budget": "64MiB", "knob_x": half}
        config = config_from_mapping(data, env={})
    return config


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


async def _one_context(ctx: KVContext, rng: random.Random, mismatches: list[str]) -> None:
    generator = torch.Generator().manual_seed(rng.randrange(2**31))

    def rows(n: int) -> torch.Tensor:
        return torch.randn((n, ctx.batch, ctx.width), generator=generator).to(ctx.dtype)

    stored: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in range(ctx.num_layers):
        n = rng.randint(1, ctx.max_len - (ctx.max_len > 1 and rng.random() < 0.5))
        stored[layer] = (rows(n), rows(n))
        await ctx.write(layer, *stored[layer])
    for _ in range(rng.randint(1, 8)):
        layer = rng.randrange(ctx.num_layers)
        k, v = stored[layer]
        if ctx.length(layer) < ctx.max_len and rng.random() < 0.5:
            k_row, v_row = rows(1), rows(1)
            await ctx.append(layer, k_row[0], v_row[0])
            stored[layer] = (torch.cat([k, k_row]), torch.cat([v, v_row]))
            continue
        start = rng.randrange(k.shape[0])
        stop = rng.randint(start + 1, k.shape[0])
        got_k, got_v = await ctx.read(layer, (start, stop))
        for name, got, want in (("k", got_k, k[start:stop]), ("v", got_v, v[start:stop])):
            if _digest(got) != _digest(want):
                mismatches.append(f"context {ctx.id} layer {layer} {name} [{start},{stop})")
    for layer, (k, v) in stored.items():
        got_k, got_v = await ctx.read(layer)
        if _digest(got_k) != _digest(k) or _digest(got_v) != _digest(v):
            mismatches.append(f"context {ctx.id} layer {layer}: full read")


async def _run(setup: Setup, policy: str, folder: Path) -> list[str]:
    config = _config(setup, policy, folder)
    mismatches: list[str] = []
    async with open_store(config, device="cpu") as store:
        assert store.runtime.engine.kind == ("io_uring" if setup.compat == "off" else "threadpool")

        async def worker(index: int) -> None:
            async with store.context() as ctx:
                await _one_context(ctx, random.Random(setup.seed * 31 + index), mismatches)

        async with anyio.create_task_group() as tg:
            for index in range(setup.contexts):
                tg.start_soon(worker, index)
        for buffer in store.runtime.buffers:
            assert buffer.inflight == 0
    return mismatches


_ITEM = {"float16": 2, "bfloat16": 2, "float32": 4}


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups)
def test_random_round_trips_have_zero_mismatches(policy: str, setup: Setup) -> None:
    row_bytes = setup.batch * setup.kv_heads * setup.head_dim * _ITEM[setup.dtype]
    event("rows padded to 4 KiB" if row_bytes % 4096 else "rows fill whole blocks")
    event(f"{setup.contexts} concurrent contexts")
    saved = os.environ.get("DUALBLADE_COMPAT")
    os.environ["DUALBLADE_COMPAT"] = setup.compat
    try:
        with tempfile.TemporaryDirectory() as folder:
            mismatches = anyio.run(_run, setup, policy, Path(folder), backend=setup.backend)
    finally:
        if saved is None:
            os.environ.pop("DUALBLADE_COMPAT", None)
        else:
            os.environ["DUALBLADE_COMPAT"] = saved
    assert mismatches == []
