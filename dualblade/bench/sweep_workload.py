"""The KV traffic of one sweep run, sized for working sets larger than memory.

:mod:`dualblade.bench.kv_workload` keeps every tensor it wrote to check reads byte for byte; a
sweep run cannot, because its KV working set is by design larger than the memory limit the run is
under. Here the data are *derived* instead of stored: layer ``l``'s prompt rows are a random base
tensor with every element's bits XOR-ed with ``l + 1``, and the row appended at decode step ``s``
is a random row XOR-ed with a code of ``(l, s)``. So any row of any layer can be recomputed, and
each read is checked on a sample of rows (the first, every 61st, the last prompt row, and every
appended row) inside the timed loop, cheaply; ``verify="full"`` recomputes and compares every row.

The access order is FlexLLMGen's: prefill produces layer after layer (a worker thread makes the
tensors, standing in for compute) with the previous layers' writes in flight; each decode step
walks the layers in order, reading layer ``l``'s K and V while up to ``copy_threads``
following layers are already being fetched, then appends the step's row; a step's tail reads
the next step's first layers, and the prefill's end the first step's, as the OPT engine does
(:class:`dualblade.models.LayerWalk`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

import anyio
import torch

from dualblade.bench.kv_workload import VerificationError
from dualblade.bench.row_sample import sampled_from, sampled_rows
from dualblade.errors import plain_errors
from dualblade.models import LayerWalk
from dualblade.pipeline import PipelineConfig, decode_read_buffers
from dualblade.store import KVContext, KVStore, ReadBuffers, torch_dtype

Verify = Literal["sample", "full"]

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class PhaseClock:
    """Wall-clock marks a caller can line other measurements up with."""

    prefill_start: float = 0.0
    prefill_end: float = 0.0
    decode_start: float = 0.0
    decode_end: float = 0.0
    step_ends: list[float] = field(default_factory=list)


@dataclass
class SweepWorkloadResult:
    """Latencies and what was checked."""

    prefill_s: float
    decode_s: float
    decode_step_s: list[float]
    strategies: list[str]
    verified_bytes: int
    clock: PhaseClock
    #: The context's own placement: (page-cache layers, direct layers).
    placement: tuple[list[int], list[int]] | None = None
    #: Of ``prefill_s``, the time spent producing the layers' tensors (the stand-in for the
    #: model's compute): it grows when the writes take CPU or memory from it.
    #: None where a real model ran (its compute is not split out).
    prefill_produce_s: float | None = None


class DerivedKV:
    """Recomputable K/V content of every layer and step (see the module docstring)."""

    def __init__(self, prompt: int, batch: int, width: int, dtype: str, seed: int) -> None:
        self.prompt = prompt
        self.dtype = torch_dtype(dtype)
        self.int_dtype = _INT_OF_SIZE[torch.empty((), dtype=self.dtype).element_size()]
        generator = torch.Generator().manual_seed(seed)

        def base(rows: int) -> torch.Tensor:
            data = torch.randn((rows, batch, width), generator=generator)
            return data.to(self.dtype).view(self.int_dtype)

        self.base = {"K": base(prompt), "V": base(prompt)}
        self.row_base = {"K": base(1), "V": base(1)}
        #: the base rows a sampled check compares, per (kind, prompt rows): gathered once
        self._sampled_base: dict[tuple[str, int], torch.Tensor] = {}

    def _code(self, layer: int, step: int | None) -> int:
        # Prompt rows: layer + 1 (1..L); appended rows: a different value for every (layer, step).
        return layer + 1 if step is None else 0x55 + 7 * (layer + 1) + 131 * (step + 1)

    def prompt_rows(
        self, kind: str, layer: int, rows: slice | list[int] | None = None
    ) -> torch.Tensor:
        """The prompt rows (all, or those selected) of ``kind`` for ``layer``."""
        base = self.base[kind] if rows is None else self.base[kind][rows]
        return torch.bitwise_xor(base, self._code(layer, None)).view(self.dtype)

    def appended_row(self, kind: str, layer: int, step: int) -> torch.Tensor:
        """The row decode step ``step`` appends to ``layer``."""
        return torch.bitwise_xor(self.row_base[kind], self._code(layer, step)).view(self.dtype)

    def sampled_prompt_rows(self, kind: str, layer: int, prompt: int) -> torch.Tensor:
        """The prompt rows of ``kind`` for ``layer`` that a sampled check of ``prompt`` rows
        compares (:func:`.row_sample.sampled_rows`), in the integer dtype."""
        key = (kind, prompt)
        base = self._sampled_base.get(key)
        if base is None:
            base = self._sampled_base[key] = self.base[kind].index_select(0, sampled_rows(prompt))
        return torch.bitwise_xor(base, self._code(layer, None))

    def check(self, kind: str, layer: int, read: torch.Tensor, verify: Verify) -> int:
        """Compare a read of rows ``[0, len(read))`` with what was written; returns the bytes
        compared.

        Raises:
            VerificationError: a checked row differs.
        """
        rows = read.shape[0]
        prompt_rows = min(rows, self.prompt)
        checked = 0
        if verify == "full":
            expected = self.prompt_rows(kind, layer, slice(0, prompt_rows)).view(self.int_dtype)
            got = read[:prompt_rows].cpu()
        else:
            expected = self.sampled_prompt_rows(kind, layer, prompt_rows)
            got = sampled_from(read, prompt_rows)
        appended = read[self.prompt :].cpu()
        if not torch.equal(got.view(self.int_dtype), expected):
            raise VerificationError(f"layer {layer} {kind}: a prompt row read back wrong")
        checked += got.numel() * got.element_size()
        for step in range(appended.shape[0]):
            want = self.appended_row(kind, layer, step)
            if not torch.equal(
                appended[step : step + 1].view(self.int_dtype), want.view(self.int_dtype)
            ):
                raise VerificationError(
                    f"layer {layer} {kind}: appended row {self.prompt + step} read back wrong"
                )
            checked += want.numel() * want.element_size()
        return checked


def derive_kv(config: PipelineConfig, seed: int) -> DerivedKV:
    """The derived content for ``config``'s shape and workload."""
    shape = config.shape()
    workload = config.workload
    return DerivedKV(workload.prompt_len, workload.batch, shape.kv_width, shape.dtype, seed)


def read_buffers(config: PipelineConfig, device: torch.device | str) -> list[ReadBuffers]:
    """One layer's full-length read buffers per layer in flight (one per copy thread) and one
    for the layer in use, as the OPT engine has (:func:`decode_read_buffers`), reused every
    step as an application reuses its own: a fresh tensor per read would time page faults,
    not KV movement. They are the store's kind (:class:`ReadBuffers`): on the host aligned
    memory that reads land in without a copy, as the OPT engine reads. Zeroed here, so their
    pages are in use before the store's budgeter first looks."""
    shape = config.shape()
    out = []
    for _ in range(decode_read_buffers(config.copy_threads)):
        buffers = ReadBuffers(
            config.workload.max_len,
            config.workload.batch,
            shape.kv_width,
            torch_dtype(shape.dtype),
            torch.device(device),
        )
        buffers.k.zero_()
        buffers.v.zero_()
        out.append(buffers)
    return out


ProgressFn = Callable[[str, int, int], None]
PhaseFn = Callable[[str], None]
#: Runs after the decode, while the context is still open (the floor's passes).
AfterDecodeFn = Callable[[KVContext], Awaitable[None]]


def _noop(_phase: str, _done: int, _total: int) -> None:
    return None


def _no_mark(_mark: str) -> None:
    return None


async def run_sweep_workload(
    store: KVStore,
    *,
    decode_steps: int,
    data: DerivedKV | None = None,
    buffers: list[ReadBuffers] | None = None,
    seed: int = 0,
    verify: Verify = "sample",
    progress: ProgressFn = _noop,
    on_phase: PhaseFn = _no_mark,
    after_decode: AfterDecodeFn | None = None,
) -> SweepWorkloadResult:
    """Prefill then ``decode_steps`` steps of one context; every read is checked.

    ``data`` is the content to write (made from ``seed`` when not given) and ``buffers`` the
    decode's read buffers (:func:`read_buffers`). A caller that runs under a memory limit makes
    both *before* opening the store, as an application loads its model first: the budgeter then
    counts them as memory in use, not as room for the page cache.

    ``on_phase`` is called with ``prefill_start``, ``prefill_end``, ``decode_start`` and
    ``decode_end`` so the caller can snapshot counters exactly at the phase boundaries;
    ``after_decode`` runs after ``decode_end``, with the context still open.
    """
    config = store.config
    shape = config.shape()
    layers = shape.num_layers
    if data is None:
        data = derive_kv(store.config, seed)
    device = store.device
    clock = PhaseClock()
    verified = 0
    async with store.context() as ctx:
        if buffers is None:
            buffers = read_buffers(config, device)
        for made_first in buffers:
            store.fix_read_buffers(made_first)  # as the engine's own buffers are
        walk = LayerWalk(ctx, buffers)  # the prefill reads the first step's layers into them
        on_phase("prefill_start")
        clock.prefill_start = time.perf_counter()
        produce_s = await _prefill(
            ctx, data, layers, device, config.copy_threads, progress, walk if decode_steps else None
        )
        clock.prefill_end = time.perf_counter()
        prefill_s = clock.prefill_end - clock.prefill_start
        on_phase("prefill_end")

        step_s: list[float] = []
        strategies: list[str] = []
        rows = [
            [
                (
                    data.appended_row("K", layer, s).to(device),
                    data.appended_row("V", layer, s).to(device),
                )
                for layer in range(layers)
            ]
            for s in range(decode_steps)
        ]
        on_phase("decode_start")
        clock.decode_start = time.perf_counter()
        for step in range(decode_steps):
            start = time.perf_counter()
            async with store.iteration() as strategy:
                more = step + 1 < decode_steps
                verified += await _decode_step(data, rows[step], walk, verify, more=more)
            step_s.append(time.perf_counter() - start)
            clock.step_ends.append(time.perf_counter())
            strategies.append(strategy)
            progress("decode", step + 1, decode_steps)
        clock.decode_end = time.perf_counter()
        on_phase("decode_end")
        if after_decode is not None:
            await after_decode(ctx)
        placement = (list(ctx.plan.placement.page_cache), list(ctx.plan.placement.direct))
    return SweepWorkloadResult(
        prefill_s, sum(step_s), step_s, strategies, verified, clock, placement, produce_s
    )


async def _prefill(
    ctx: KVContext,
    data: DerivedKV,
    layers: int,
    device: torch.device | str,
    behind: int,
    progress: ProgressFn,
    walk: LayerWalk | None = None,
) -> float:
    """Write every layer's prompt K and V, producing layer ``l + 1`` while layer ``l`` is
    written.

    Producing a layer's tensors (a worker thread, as a model's compute) stands in for the
    model's prefill compute, and up to ``behind`` layers' writes stay in flight behind it, as
    FlexLLMGen overlaps a layer's store with the next layer's compute and as
    :class:`dualblade.models.opt.OptModel` does. The timer around this function therefore holds
    what a prefill costs an application: the compute, the writes it could not hide, and what the
    writes take from the compute (a baseline's page faults into its shared mapping use the same
    CPUs, and its dirty pages fill the cgroup so that fresh allocations wait for reclaim).
    ``walk``: the decode that follows; its first step's first layers are read back under the
    last writes, as the engine's prefill reads them (:meth:`LayerWalk.read_first`).
    Returns the time spent producing.
    """
    produce_s = 0.0

    def produce(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal produce_s
        start = time.perf_counter()
        k, v = data.prompt_rows("K", layer).to(device), data.prompt_rows("V", layer).to(device)
        produce_s += time.perf_counter() - start
        return k, v

    in_flight = anyio.Semaphore(max(1, behind))
    written = 0
    landed = [anyio.Event() for _ in range(layers)]

    async def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        nonlocal written
        try:
            await ctx.write(layer, k, v)
        finally:
            in_flight.release()
        landed[layer].set()
        written += 1
        progress("prefill", written, layers)

    with plain_errors():
        async with anyio.create_task_group() as tg:
            for layer in range(layers):
                k, v = await anyio.to_thread.run_sync(produce, layer)
                await in_flight.acquire()
                tg.start_soon(write, layer, k, v)
                del k, v
            if walk is not None:
                walk.read_first(tg, landed)
    return produce_s


async def _decode_step(
    data: DerivedKV,
    new_rows: list[tuple[torch.Tensor, torch.Tensor]],
    walk: LayerWalk,
    verify: Verify,
    *,
    more: bool,
) -> int:
    """One decode step in layer order, each layer read ahead of its check in the context's
    read order and, with ``more``, the next step's first layers read in its tail, as the OPT
    engine's decode reads (:class:`dualblade.models.LayerWalk`)."""
    checked = 0

    async def use(
        layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal checked
        checked += data.check("K", layer, k, verify)
        checked += data.check("V", layer, v, verify)
        return new_rows[layer]

    await walk.step(use, more=more)
    return checked
