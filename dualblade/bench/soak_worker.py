"""The soak's workers: each opens one context after another and drives it at random.

A session is a context's life: random writes (prefills), appends (decode steps) and reads, some
under a short random deadline, then a last full read of every layer that survived. Every byte
read is compared, as integers, with what the context stored; every fault injected during an
operation is accounted to it (:meth:`Ledger.account`). A write that failed or was cut leaves
its layer *lost*, and a lost layer must be refused until it is written again.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from dualblade.bench.soak_ledger import ContextStorage, Ledger
from dualblade.bench.soak_options import PROMPT_LEN, SoakOptions
from dualblade.errors import DualbladeError
from dualblade.store import KVContext, KVStore, LayerLostError
from dualblade.testing import FaultLog


def _random_rows(ctx: KVContext, rows: int, generator: torch.Generator) -> torch.Tensor:
    """Random bit patterns (any 16-bit value, NaNs included: compared as integers)."""
    raw = torch.randint(
        -(2**15), 2**15, (rows, ctx.batch, ctx.width), dtype=torch.int16, generator=generator
    )
    return raw.view(ctx.dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@dataclass
class _ContextState:
    storage: ContextStorage
    expected: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)


class Soak:
    """One soak run over an open store; :meth:`run_workers` drives it until ``deadline``."""

    def __init__(
        self, store: KVStore, faults: FaultLog, options: SoakOptions, deadline: float
    ) -> None:
        self.store = store
        self.faults = faults
        self.options = options
        self.deadline = deadline
        self.ledger = Ledger(disk_full_expected=options.full_disk)
        #: what --pressure did so far (None without it), for reports while it runs
        self.pressure: dict[str, Any] | None = None
        self.direct_target = store.stats().direct_target  # the name its faults are logged under

    def status(self, elapsed: float, rss_bytes: int) -> str:
        """One progress line: time, memory, and what the workers have done so far."""
        ledger = self.ledger
        return (
            f"{elapsed:7.1f} s  rss {rss_bytes / 2**20:7.1f} MiB  "
            f"verified {ledger.bytes_verified / 2**20:9.1f} MiB  "
            f"ops {sum(ledger.ops.values())}  mismatches {ledger.mismatches}  "
            f"faults {self.faults.serial}"
        )

    async def run_workers(self) -> None:
        async with anyio.create_task_group() as tg:
            for index in range(self.options.contexts):
                tg.start_soon(self._worker, index)

    async def _worker(self, index: int) -> None:
        rng = random.Random(self.options.seed * 100_003 + index)
        generator = torch.Generator().manual_seed(self.options.seed * 100_003 + index)
        while time.monotonic() < self.deadline:
            async with self.store.context() as ctx:
                await self._session(ctx, rng, generator)
            self.ledger.contexts += 1

    async def _session(
        self, ctx: KVContext, rng: random.Random, generator: torch.Generator
    ) -> None:
        region = None
        if ctx.plan.placement.direct:
            try:
                lba_map = await ctx.direct_map()
            except DualbladeError as error:  # no room for its run (a full disk)
                self.ledger.ops["claim"] += 1
                self.ledger.errors[type(error).__name__] += 1
                storage = ContextStorage(ctx.id, self.direct_target, None)
                self.ledger.account(storage, "claim", [], error, cut=False)
                await anyio.sleep(0.01)  # the disk is full: do not spin
                return
            size = lba_map.lba_size
            region = (lba_map.region.first_lba * size, lba_map.region.end * size)
        state = _ContextState(ContextStorage(ctx.id, self.direct_target, region))
        for _ in range(rng.randint(8, 40)):
            if time.monotonic() >= self.deadline:
                break
            await self._one(ctx, state, rng, generator)
        for layer in sorted(state.expected):  # a last full check of what survived
            await self._operate(ctx, state, "read", layer, rng, generator, cancel=False)

    async def _one(
        self,
        ctx: KVContext,
        state: _ContextState,
        rng: random.Random,
        generator: torch.Generator,
    ) -> None:
        layer = rng.randrange(ctx.num_layers)
        if layer in state.lost and rng.random() < 0.5:
            await self._check_refused(ctx, layer)
            return
        if layer not in state.expected:
            op = "write"
        else:
            roll = rng.random()
            room = ctx.length(layer) < ctx.max_len
            op = "write" if roll < 0.15 else "append" if roll < 0.55 and room else "read"
        cancel = rng.random() < self.options.cancel_rate
        await self._operate(ctx, state, op, layer, rng, generator, cancel=cancel)

    async def _check_refused(self, ctx: KVContext, layer: int) -> None:
        self.ledger.ops["read-lost"] += 1
        try:
            await ctx.read(layer)
        except LayerLostError:
            self.ledger.lost_refusals += 1
            return
        self.ledger.mismatch(f"context {ctx.id} layer {layer}: a lost layer served data")

    async def _operate(
        self,
        ctx: KVContext,
        state: _ContextState,
        op: str,
        layer: int,
        rng: random.Random,
        generator: torch.Generator,
        *,
        cancel: bool,
    ) -> None:
        ledger = self.ledger
        ledger.ops[op] += 1
        before = ctx.length(layer)
        rows_read: tuple[int, int] | None = None
        if op == "write":
            rows = rng.randint(1, PROMPT_LEN)
            payload = (_random_rows(ctx, rows, generator), _random_rows(ctx, rows, generator))
        elif op == "append":
            payload = (_random_rows(ctx, 1, generator), _random_rows(ctx, 1, generator))
        else:
            payload = None
            if rng.random() < 0.3 and before > 1:
                start = rng.randrange(before)
                rows_read = (start, rng.randint(start + 1, before))
        mark = self.faults.serial
        error: DualbladeError | None = None
        result: Any = None
        delay = rng.uniform(0, 0.004) if cancel else math.inf
        with anyio.move_on_after(delay) as scope:
            try:
                if op == "write":
                    assert payload is not None
                    await ctx.write(layer, *payload)
                elif op == "append":
                    assert payload is not None
                    await ctx.append(layer, payload[0][0], payload[1][0])
                else:
                    result = await ctx.read(layer, rows_read)
            except DualbladeError as caught:
                error = caught
        cut = scope.cancelled_caught
        ledger.cancellations += cut
        if error is not None:
            ledger.errors[type(error).__name__] += 1
        ledger.account(state.storage, op, self.faults.since(mark), error, cut)
        done = error is None and not cut
        if op == "write":
            assert payload is not None
            if done:
                state.expected[layer] = payload
                state.lost.discard(layer)
                ledger.bytes_written += sum(t.nbytes for t in payload)
            else:
                state.expected.pop(layer, None)
                state.lost.add(layer)
        elif op == "append":
            assert payload is not None
            if done:
                old_k, old_v = state.expected[layer]
                state.expected[layer] = (
                    torch.cat([old_k, payload[0]]),
                    torch.cat([old_v, payload[1]]),
                )
                ledger.bytes_written += sum(t.nbytes for t in payload)
            elif ctx.length(layer) != before:
                ledger.mismatch(f"context {ctx.id} layer {layer}: a failed append moved length")
        elif done:
            want_k, want_v = state.expected[layer]
            if rows_read is not None:
                want_k, want_v = want_k[slice(*rows_read)], want_v[slice(*rows_read)]
            k, v = result
            if _same(k, want_k) and _same(v, want_v):
                ledger.bytes_verified += k.nbytes + v.nbytes
            else:
                ledger.mismatch(f"context {ctx.id} layer {layer} rows {rows_read}: wrong bytes")
