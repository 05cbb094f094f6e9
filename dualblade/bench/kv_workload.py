"""A synthetic OPT-shaped KV workload: prefill, then decode steps of KV traffic, verified.

It moves exactly the KV bytes a decoder of the config's shape would — prefill writes every
layer's K and V for the prompt, each decode step reads every layer's cache back and appends one
row — with random tensors instead of a model, so the storage pipeline can be measured and
checked in isolation. Every read is compared with what was written: a wrong byte fails the run.

Decode mirrors FlexLLMGen's layer loop with prefetch: the next layer's load is in flight while
the current layer is "computed" (appended), up to the number of copy threads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from dualblade.errors import DualbladeError, plain_errors
from dualblade.store import KVContext, KVStore, torch_dtype


class VerificationError(DualbladeError):
    """A read returned bytes other than those written."""


@dataclass
class WorkloadResult:
    """What one run measured."""

    prefill_s: float
    decode_s: float
    decode_step_s: list[float] = field(default_factory=list)
    strategies: list[str] = field(default_factory=list)
    verified_bytes: int = 0
    prefill_written_bytes: int = 0
    decode_read_bytes: int = 0


ProgressFn = Callable[[str, int, int], None]


def _noop(_phase: str, _done: int, _total: int) -> None:
    return None


async def run_kv_workload(
    store: KVStore,
    *,
    decode_steps: int | None = None,
    seed: int = 0,
    progress: ProgressFn = _noop,
    verify: bool = True,
) -> WorkloadResult:
    """Prefill and decode one context of ``store``'s shape; returns the timings."""
    config = store.config
    shape = config.shape()
    batch, prompt = config.workload.batch, config.workload.prompt_len
    steps = config.workload.max_new_tokens if decode_steps is None else decode_steps
    if steps > config.workload.max_new_tokens:
        limit = config.workload.max_new_tokens
        raise DualbladeError(f"{steps} decode steps exceed workload.max_new_tokens ({limit})")
    generator = torch.Generator().manual_seed(seed)
    dtype = torch_dtype(shape.dtype)
    device = store.device
    layers = shape.num_layers

    def random_rows(rows: int) -> torch.Tensor:
        data = torch.randn((rows, batch, shape.kv_width), generator=generator, dtype=torch.float32)
        return data.to(dtype).to(device)

    expected: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    result = WorkloadResult(prefill_s=0.0, decode_s=0.0)
    # Generated before the clock starts: making random numbers is not the pipeline's cost.
    prefill = [(random_rows(prompt), random_rows(prompt)) for _ in range(layers)]
    async with store.context() as ctx:
        start = time.perf_counter()
        for layer, (k, v) in enumerate(prefill):
            await ctx.write(layer, k, v)
            if verify:
                expected[layer] = (k, v)
            progress("prefill", layer + 1, layers)
        result.prefill_s = time.perf_counter() - start
        del prefill
        result.prefill_written_bytes = _moved(store, "write_bytes")
        read_before = _moved(store, "read_bytes")

        for step in range(steps):
            new_rows = [(random_rows(1), random_rows(1)) for _ in range(layers)]
            reads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            step_start = time.perf_counter()
            async with store.iteration() as strategy:
                await _decode_step(ctx, new_rows, reads)
            result.decode_step_s.append(time.perf_counter() - step_start)
            result.strategies.append(strategy)
            if verify:  # outside the timed step: checking is not the pipeline's cost
                result.verified_bytes += _verify(reads, expected, new_rows)
            progress("decode", step + 1, steps)
        result.decode_s = sum(result.decode_step_s)
        result.decode_read_bytes = _moved(store, "read_bytes") - read_before
    return result


def _moved(store: KVStore, key: str) -> int:
    counts = store.metrics()[key]
    assert isinstance(counts, dict)
    return sum(counts.values())


async def _decode_step(
    ctx: KVContext,
    new_rows: list[tuple[torch.Tensor, torch.Tensor]],
    reads: dict[int, tuple[torch.Tensor, torch.Tensor]],
) -> None:
    async def one(layer: int) -> None:
        reads[layer] = await ctx.read(layer)
        k_row, v_row = new_rows[layer]
        await ctx.append(layer, k_row, v_row)

    # Layers are independent in this synthetic step; the copy-thread pool bounds how many are
    # in flight, which is the prefetch depth.
    with plain_errors():
        async with anyio.create_task_group() as tg:
            for layer in range(len(new_rows)):
                tg.start_soon(one, layer)


def _verify(
    reads: dict[int, tuple[torch.Tensor, torch.Tensor]],
    expected: dict[int, tuple[torch.Tensor, torch.Tensor]],
    new_rows: list[tuple[torch.Tensor, torch.Tensor]],
) -> int:
    """Compare a step's reads with what was written, then extend the expectation."""
    checked = 0
    for layer, (k, v) in reads.items():
        want_k, want_v = expected[layer]
        if not (torch.equal(k, want_k) and torch.equal(v, want_v)):
            raise VerificationError(f"layer {layer}: read back other bytes than written")
        checked += 2 * k.numel() * k.element_size()
        k_row, v_row = new_rows[layer]
        expected[layer] = (torch.cat([want_k, k_row]), torch.cat([want_v, v_row]))
    return checked


def summarize(store: KVStore, result: WorkloadResult) -> dict[str, Any]:
    """The run's report: latencies, path split, hit rate, strategy."""
    metrics = store.metrics()
    placement = store.plan.placement
    return {
        "policy": store.config.policy,
        "prefill_s": round(result.prefill_s, 6),
        "decode_s": round(result.decode_s, 6),
        "decode_step_s": [round(s, 6) for s in result.decode_step_s],
        "strategy": metrics["strategy"],
        "strategies_by_step": result.strategies,
        "path_split": {
            "page_cache_layers": list(placement.page_cache),
            "direct_layers": list(placement.direct),
            "page_cache_bytes": placement.page_cache_bytes,
            "direct_bytes": placement.direct_bytes,
        },
        "read_bytes": metrics["read_bytes"],
        "write_bytes": metrics["write_bytes"],
        "page_cache_hit_rate": metrics["page_cache_hit_rate"],
        "page_cache_budget_bytes": metrics["page_cache_budget_bytes"],
        "verified_bytes": result.verified_bytes,
        "prefill_write_bytes_per_s": round(result.prefill_written_bytes / result.prefill_s)
        if result.prefill_s
        else None,
        "decode_read_bytes_per_s": round(result.decode_read_bytes / result.decode_s)
        if result.decode_s
        else None,
        "co_dma": metrics["co_dma"],
        "device": str(store.device),
    }
