"""Many requests on one store: the KV traffic of a serving run, with random tensors.

Each request arrives at its time (:mod:`.serving_requests`), opens a context of its own shape,
waits for its turn to prefill (one prompt at a time, as one accelerator computes them; the
produced layers are the service's memory, and six prompts produced at once would take a third
of a small limit), prefills every layer (a worker thread produces each layer's K and V,
standing in for compute, with up to one write per copy thread in flight behind it), then
decodes: every step reads each
layer back in layer order (as many layers prefetched as the store has copy threads, into the
request's own read buffers) and appends one row. Requests run concurrently, as a service's do.

The content is derived, not stored (as in :mod:`.sweep_workload`): request ``r``'s prompt rows of
layer ``l`` are a random base, cut to the request's shape, XOR a code of ``(r, l)``; each
appended row a random row XOR a code of ``(r, l, step)``. Every read is checked on a sample of
prompt rows and two appended rows (the newest, and one that rotates); a wrong byte fails the
run. Checking every appended row of every layer each step cost as much as the reads.

While requests run, a sampler reads how many bytes of the live contexts' page-cache files are
resident (``mincore``) against the store's ledger budget at that instant.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from dualblade.bench.kv_workload import VerificationError
from dualblade.bench.row_sample import sampled_from, sampled_rows
from dualblade.bench.serving_requests import RequestSpec
from dualblade.errors import plain_errors
from dualblade.models import LayerWalk
from dualblade.store import KVContext, KVStore, ReadBuffers, torch_dtype

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Seconds between residency samples.
SAMPLE_INTERVAL = 0.1


class ServingKV:
    """Recomputable K/V content of every request, layer and step (see the module docstring)."""

    def __init__(self, max_prompt: int, max_batch: int, width: int, dtype: str, seed: int) -> None:
        self.dtype = torch_dtype(dtype)
        self.int_dtype = _INT_OF_SIZE[torch.empty((), dtype=self.dtype).element_size()]
        generator = torch.Generator().manual_seed(seed)

        def base(rows: int) -> torch.Tensor:
            data = torch.randn((rows, max_batch, width), generator=generator)
            return data.to(self.dtype).view(self.int_dtype)

        self.base = {"K": base(max_prompt), "V": base(max_prompt)}
        self.row_base = {"K": base(1), "V": base(1)}
        #: the base rows a sampled check compares, per (kind, prompt rows, batch): gathered once
        self._sampled_base: dict[tuple[str, int, int], torch.Tensor] = {}

    @staticmethod
    def _code(request: int, layer: int, step: int | None) -> int:
        if step is None:
            return (request * 131 + layer + 1) & 0x7F
        return (0x55 + 7 * (layer + 1) + 131 * (step + 1) + 29 * request) & 0x7F

    def prompt_rows(self, kind: str, request: RequestSpec, layer: int) -> torch.Tensor:
        """The prompt rows of ``kind`` for the request's ``layer``."""
        base = self.base[kind][: request.prompt_len, : request.batch]
        code = self._code(request.index, layer, None)
        return torch.bitwise_xor(base, code).contiguous().view(self.dtype)

    def appended_row(self, kind: str, request: RequestSpec, layer: int, step: int) -> torch.Tensor:
        base = self.row_base[kind][:, : request.batch]
        code = self._code(request.index, layer, step)
        return torch.bitwise_xor(base, code).contiguous().view(self.dtype)

    def check(self, kind: str, request: RequestSpec, layer: int, read: torch.Tensor) -> int:
        """Compare a sample of the prompt rows, the newest appended row and one that rotates;
        returns the bytes compared.

        Raises:
            VerificationError: a checked row differs.
        """
        prompt = min(read.shape[0], request.prompt_len)
        key = (kind, prompt, request.batch)
        base = self._sampled_base.get(key)
        if base is None:
            rows = sampled_rows(prompt)
            base = self._sampled_base[key] = self.base[kind][:, : request.batch].index_select(
                0, rows
            )
        want = torch.bitwise_xor(base, self._code(request.index, layer, None))
        got = sampled_from(read, prompt)
        if not torch.equal(got.view(self.int_dtype), want):
            raise VerificationError(
                f"request {request.index} layer {layer} {kind}: a prompt row read back wrong"
            )
        checked = got.numel() * got.element_size()
        appended = read.shape[0] - request.prompt_len
        # the newest row and one that rotates with the length (every row now and then)
        for step in {appended - 1, read.shape[0] % appended} if appended > 0 else ():
            row = self.appended_row(kind, request, layer, step)
            at = request.prompt_len + step
            got_row = read[at : at + 1].cpu()
            if not torch.equal(got_row.view(self.int_dtype), row.view(self.int_dtype)):
                raise VerificationError(
                    f"request {request.index} layer {layer} {kind}: appended row "
                    f"{request.prompt_len + step} read back wrong"
                )
            checked += row.numel() * row.element_size()
        return checked


def request_buffers(
    request: RequestSpec, width: int, dtype: str, device: torch.device | str, count: int
) -> list[ReadBuffers]:
    """A request's ``count`` read buffers, made and touched up front: the service's own memory,
    in use before the store's budgeter first looks.

    The serving worker gives each request one per copy thread, one fewer than the OPT engine
    (:func:`dualblade.pipeline.decode_read_buffers`). Every request in flight holds its
    buffers, and with the engine's count dual served 30.2-31.9 tokens/s at 640 MiB against
    33.4-36.6 with one per copy thread (the serving preset, two alternating invocations;
    docs/serving-bench.md)."""
    out = []
    for _ in range(max(1, count)):
        buffers = ReadBuffers(
            request.max_len, request.batch, width, torch_dtype(dtype), torch.device(device)
        )
        buffers.k.zero_()
        buffers.v.zero_()
        out.append(buffers)
    return out


async def sleep_until(moment: float, clock: Callable[[], float]) -> None:
    """Sleep until ``clock()`` reads ``moment`` or later. uvloop's timers count whole
    milliseconds of a clock it reads once per loop turn, so one sleep may end up to 1 ms early:
    a request opened before its arrival, and its TTFT read less than its prefill."""
    while (left := moment - clock()) > 0:
        await anyio.sleep(left)


@dataclass
class RequestRecord:
    """What one request saw, in seconds since the run's start."""

    spec: RequestSpec
    opened_s: float = 0.0
    first_token_s: float = 0.0
    finished_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    verified_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        spec = self.spec
        return {
            **spec.to_dict(),
            "opened_s": round(self.opened_s, 4),
            "prefill_s": round(self.first_token_s - self.opened_s, 4),
            "ttft_s": round(self.first_token_s - spec.arrival_s, 4),
            "first_token_s": round(self.first_token_s, 4),
            "finished_s": round(self.finished_s, 4),
            "step_s": [round(s, 5) for s in self.step_s],
            "tokens": spec.batch * spec.new_tokens,
            "verified_bytes": self.verified_bytes,
        }


class ResidencySampler:
    """Samples ``[t, resident bytes of the live contexts' files, ledger budget, placed]``."""

    def __init__(self, store: KVStore, start: float) -> None:
        self.store = store
        self.start = start
        self.live: dict[int, KVContext] = {}
        self.samples: list[list[float]] = []

    def sample(self) -> None:
        resident = 0
        for ctx in list(self.live.values()):
            for file in ctx.page_cache_files():
                try:
                    resident += file.resident_bytes(0, file.size)
                except (OSError, ValueError):  # closed under us: its pages are gone
                    continue
        ledger = self.store.stats().ledger
        now = time.perf_counter() - self.start
        self.samples.append([round(now, 3), resident, ledger.budget_bytes, ledger.placed_bytes])

    async def run(self) -> None:
        while True:
            self.sample()
            await anyio.sleep(SAMPLE_INTERVAL)


ProgressFn = Callable[[str, int, int], None]


def _noop(_phase: str, _done: int, _total: int) -> None:
    return None


async def run_serving_workload(
    store: KVStore,
    requests: Sequence[RequestSpec],
    data: ServingKV,
    buffers: dict[int, list[ReadBuffers]],
    *,
    progress: ProgressFn = _noop,
) -> tuple[list[RequestRecord], ResidencySampler]:
    """Serve ``requests`` on ``store`` at their arrival times; returns each request's record
    and the residency samples. ``buffers[index]``: the request's read buffers."""
    start = time.perf_counter()
    sampler = ResidencySampler(store, start)
    layers = store.config.shape().num_layers
    behind = max(1, store.config.copy_threads)
    records = [RequestRecord(spec) for spec in requests]
    prefill_turn = anyio.Lock()
    done = 0

    def now() -> float:
        return time.perf_counter() - start

    async def serve(record: RequestRecord) -> None:
        nonlocal done
        spec = record.spec
        await sleep_until(spec.arrival_s, now)
        record.opened_s = now()
        async with store.context(batch=spec.batch, max_len=spec.max_len) as ctx:
            sampler.live[ctx.id] = ctx
            try:
                async with prefill_turn:  # one prompt at a time, as one accelerator computes
                    await _prefill(ctx, data, spec, layers, behind)
                record.first_token_s = now()
                for step in range(spec.decode_steps):
                    began = time.perf_counter()
                    async with store.iteration():
                        record.verified_bytes += await _decode_step(
                            ctx, data, spec, step, buffers[spec.index]
                        )
                    record.step_s.append(time.perf_counter() - began)
            finally:
                sampler.live.pop(ctx.id, None)
        record.finished_s = now()
        done += 1
        progress("requests", done, len(records))

    with plain_errors():
        async with anyio.create_task_group() as outer:
            outer.start_soon(sampler.run)
            async with anyio.create_task_group() as tg:
                for record in records:
                    tg.start_soon(serve, record)
            outer.cancel_scope.cancel()
    sampler.sample()
    return records, sampler


async def _prefill(
    ctx: KVContext, data: ServingKV, spec: RequestSpec, layers: int, behind: int
) -> None:
    """Every layer's prompt K and V, layer ``l + 1`` produced while ``l`` is written."""
    in_flight = anyio.Semaphore(behind)
    device = ctx.store.device

    def produce(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            data.prompt_rows("K", spec, layer).to(device),
            data.prompt_rows("V", spec, layer).to(device),
        )

    async def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        try:
            await ctx.write(layer, k, v)
        finally:
            in_flight.release()

    async with anyio.create_task_group() as tg:
        for layer in range(layers):
            k, v = await anyio.to_thread.run_sync(produce, layer)
            await in_flight.acquire()
            tg.start_soon(write, layer, k, v)
            del k, v


async def _decode_step(
    ctx: KVContext, data: ServingKV, spec: RequestSpec, step: int, buffers: list[ReadBuffers]
) -> int:
    """One step in layer order, one read in flight per buffer pair; returns bytes checked.

    Each step is walked on its own (nothing read for the request's next step in its tail), as
    the serving preset's figures were measured (docs/serving-bench.md): with many requests in
    flight on one store's copy threads, a request's reads for a step it has not begun would
    queue beside other requests' reads for the steps they are in. Not measured with the carry."""
    checked = 0
    device = ctx.store.device

    async def use(
        layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal checked
        checked += data.check("K", spec, layer, k) + data.check("V", spec, layer, v)
        return (
            data.appended_row("K", spec, layer, step).to(device),
            data.appended_row("V", spec, layer, step).to(device),
        )

    await LayerWalk(ctx, buffers, carry=False).step(use, more=False)
    return checked
