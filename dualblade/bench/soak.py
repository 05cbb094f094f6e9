r"""The soak: many concurrent contexts, random faults and cancellations, every byte checked.

A store runs on a direct file (in a scratch folder it removes afterwards) wrapped in a
:class:`~dualblade.testing.FaultyTarget`, with page-cache files that are
:class:`~dualblade.testing.FaultyPageCacheFile`\ s, so faults hit both paths
(not the baseline's memory map, which bypasses the engine). ``contexts`` workers each open a
context after another and drive it with random writes (prefills), appends (decode steps) and
reads, some cancelled at a random moment, and compare every byte read with what the context
stored. Injected faults are accounted for per operation: the faults that landed in the
context's own storage (its direct run, its page-cache files) during the operation must have
surfaced as that operation's error (one
of them; the rest were *coalesced* into it), or the operation was cancelled; a hard fault that
vanished (*swallowed*), an error nobody injected, or a fault in no one's run fails the soak.

Resident and pinned memory are sampled all along; the growth of RSS is measured between the
end of the first window (allocations at steady state) and the end of the last. Afterwards the
process must hold no more file descriptors or threads than before, no buffer may be under I/O
and the binder must hold no extent or file.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import torch

from dualblade.actors import Book, GetBook, Reply
from dualblade.bench.process_stats import (
    MemorySample,
    describe_fds,
    live_threads,
    memory_sample,
    open_fds,
)
from dualblade.errors import ConfigError, DualbladeError
from dualblade.io_engine import Target
from dualblade.pipeline import (
    PipelineConfig,
    config_from_mapping,
    default_cache_dir,
    layer_page_cache_bytes,
)
from dualblade.store import KVContext, KVStore, LayerLostError, open_store
from dualblade.testing import (
    FaultKind,
    FaultLog,
    FaultPolicy,
    FaultyPageCacheFile,
    FaultyTarget,
    InjectedFault,
    InjectedIOError,
)

#: A small GQA shape whose rows (3 × 4 × 64 bfloat16 = 1.5 KiB) are padded to 4 KiB blocks.
SOAK_MODEL: dict[str, Any] = {
    "num_layers": 4,
    "hidden_size": 512,
    "num_heads": 8,
    "num_kv_heads": 4,
    "dtype": "bfloat16",
}
SOAK_BATCH = 3
PROMPT_LEN = 48
NEW_TOKENS = 16
#: Small chunks, so a KPU transfer is several chunks and faults hit the middle of requests.
MAX_CHUNK = 64 << 10

Progress = Callable[[str], None]


@dataclass(frozen=True)
class SoakOptions:
    """What to run.

    Args:
        seconds: how long workers start new operations.
        contexts: concurrent workers, each with one open context at a time.
        seed: seeds data, operations, cancellations and faults.
        fault_rate: share of direct-path chunks that get a fault.
        cancel_rate: share of operations run under a random short deadline.
        policy: the store's placement policy (faults hit its direct path).
        workdir: where the scratch folder goes (default: dualblade's cache folder).
        sample_s: seconds between memory samples (default: a twelfth of the run, at most 5).
        max_rss_growth: the run fails above this growth (checked for runs of two minutes or more).
    """

    seconds: float
    contexts: int
    seed: int = 0
    fault_rate: float = 0.02
    cancel_rate: float = 0.1
    policy: str = "dual"
    workdir: Path | None = None
    sample_s: float | None = None
    max_rss_growth: float = 0.05

    def check(self) -> None:
        """Raises ConfigError for values that cannot run."""
        if not self.seconds > 0 or not math.isfinite(self.seconds):
            raise ConfigError(f"the soak needs a positive duration, got {self.seconds} s")
        if not 1 <= self.contexts <= 1024:
            raise ConfigError(f"--contexts must be in 1..1024, got {self.contexts}")
        if not 0 <= self.fault_rate <= 1:
            raise ConfigError(f"--fault-rate must be in [0, 1], got {self.fault_rate}")
        if not 0 <= self.cancel_rate <= 1:
            raise ConfigError(f"--cancel-rate must be in [0, 1], got {self.cancel_rate}")


def soak_config(options: SoakOptions, folder: Path) -> PipelineConfig:
    """The store the soak runs: small GQA shape, direct file and page-cache files in ``folder``."""
    data: dict[str, Any] = {
        "model": SOAK_MODEL,
        "workload": {
            "batch": SOAK_BATCH,
            "prompt_len": PROMPT_LEN,
            "max_new_tokens": NEW_TOKENS,
        },
        "memory": {"page_cache_budget": "64MiB"},
        "storage": {"direct": {"path": str(folder / "direct.kv")}, "page_cache_dir": str(folder)},
        "policy": options.policy,
        "max_chunk": MAX_CHUNK,
    }
    config = config_from_mapping(data, env={})
    # Half of the layers on each path under ``dual`` (and evicted under ``cache-policy``).
    layers = layer_page_cache_bytes(config)
    half = sum(layers[: len(layers) // 2])
    data["memory"] = {"page_cache_budget": "64MiB", "knob_x": half}
    return config_from_mapping(data, env={})


@dataclass
class Ledger:
    """Everything the workers observed."""

    ops: Counter[str] = field(default_factory=Counter)
    contexts: int = 0
    bytes_written: int = 0
    bytes_verified: int = 0
    mismatches: int = 0
    mismatch_examples: list[str] = field(default_factory=list)
    cancellations: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    lost_refusals: int = 0
    surfaced: Counter[str] = field(default_factory=Counter)
    coalesced: Counter[str] = field(default_factory=Counter)
    during_cancel: Counter[str] = field(default_factory=Counter)
    absorbed: Counter[str] = field(default_factory=Counter)  # short/slow: retried, invisible
    swallowed: Counter[str] = field(default_factory=Counter)
    by_path: Counter[str] = field(default_factory=Counter)  # "direct" or "page-cache"
    unexpected: list[str] = field(default_factory=list)  # the first few
    unexpected_count: int = 0

    def mismatch(self, what: str) -> None:
        self.mismatches += 1
        if len(self.mismatch_examples) < 10:
            self.mismatch_examples.append(what)

    def unexpected_error(self, what: str) -> None:
        self.unexpected_count += 1
        if len(self.unexpected) < 20:
            self.unexpected.append(what)

    def attributed(self) -> Counter[str]:
        """Faults accounted to some operation, by kind."""
        total: Counter[str] = Counter()
        for part in (self.surfaced, self.coalesced, self.during_cancel, self.absorbed):
            total.update(part)
        total.update(self.swallowed)
        return total


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
    expected: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)
    region: tuple[int, int] | None = None  # byte range of its direct run
    direct_name: str = ""  # the direct target's name (page-cache files have their own)


class Soak:
    """One soak run over an open store; :meth:`run_workers` drives it."""

    def __init__(
        self, store: KVStore, faults: FaultLog, options: SoakOptions, deadline: float
    ) -> None:
        self.store = store
        self.faults = faults
        self.options = options
        self.deadline = deadline
        self.ledger = Ledger()

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
        state = _ContextState()
        if ctx.plan.placement.direct:
            lba_map = await ctx.direct_map()
            size = lba_map.lba_size
            state.region = (lba_map.region.first_lba * size, lba_map.region.end * size)
        state.direct_name = self.store.runtime.direct.name
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
        self._account(ctx, state, op, self.faults.since(mark), error, cut)
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

    def _account(
        self,
        ctx: KVContext,
        state: _ContextState,
        op: str,
        faults: list[InjectedFault],
        error: DualbladeError | None,
        cut: bool,
    ) -> None:
        """Match the faults injected into this context's run during ``op`` with its outcome."""
        ledger = self.ledger
        mine = [f for f in faults if _belongs(f, ctx, state)]
        for fault in mine:
            ledger.by_path["direct" if fault.target == state.direct_name else "page-cache"] += 1
        hard = [f for f in mine if f.kind.hard]
        for fault in mine:
            if not fault.kind.hard:
                ledger.absorbed[fault.kind.value] += 1
        if isinstance(error, InjectedIOError):
            match = [f for f in hard if f.serial == error.serial]
            if not match:
                ledger.unexpected_error(
                    f"context {ctx.id} {op}: fault #{error.serial} is not one of its own"
                )
            for fault in hard:
                bucket = ledger.surfaced if fault in match else ledger.coalesced
                bucket[fault.kind.value] += 1
        elif error is not None:
            ledger.unexpected_error(f"context {ctx.id} {op}: {type(error).__name__}: {error}")
            for fault in hard:
                ledger.coalesced[fault.kind.value] += 1
        elif cut:
            for fault in hard:
                ledger.during_cancel[fault.kind.value] += 1
        else:
            for fault in hard:
                ledger.swallowed[fault.kind.value] += 1


def _belongs(fault: InjectedFault, ctx: KVContext, state: _ContextState) -> bool:
    """The fault hit this context's storage: its direct run, or one of its page-cache files."""
    if fault.target == state.direct_name:
        region = state.region
        return region is not None and region[0] <= fault.offset < region[1]
    return f"{os.sep}context-{ctx.id}{os.sep}" in fault.target


@dataclass
class _Sampler:
    """Memory samples ``(seconds since start, sample)``."""

    start: float
    samples: list[tuple[float, MemorySample]] = field(default_factory=list)

    def take(self) -> MemorySample:
        sample = memory_sample()
        self.samples.append((time.monotonic() - self.start, sample))
        return sample

    async def run(self, every: float, progress: Progress | None, soak: Soak) -> None:
        while True:
            await anyio.sleep(every)
            sample = self.take()
            if progress is not None:
                ledger = soak.ledger
                progress(
                    f"{self.samples[-1][0]:7.1f} s  rss {sample.rss_bytes / 2**20:7.1f} MiB  "
                    f"verified {ledger.bytes_verified / 2**20:9.1f} MiB  "
                    f"ops {sum(ledger.ops.values())}  mismatches {ledger.mismatches}  "
                    f"faults {soak.faults.serial}"
                )

    def windows(self, seconds: float, slack: float) -> tuple[float, list[dict[str, Any]]]:
        """Per-minute windows (halves of runs under two minutes): last and peak readings.

        A window's reading is its last sample, taken up to ``slack`` seconds after its end (the
        sampler's tick): the first window's is the state after warm-up, at the end of minute 1.
        """
        width = 60.0 if seconds >= 120 else seconds / 2
        count = max(1, math.ceil(seconds / width - 1e-9))
        out = []
        for index in range(count):
            low, high = index * width + slack, (index + 1) * width + slack
            inside = [s for t, s in self.samples if low < t <= high]
            inside = inside or [s for t, s in self.samples if t <= high][-1:]
            if not inside:
                continue
            out.append(
                {
                    "window": index + 1,
                    "end_s": round(high - slack, 1),
                    "rss_bytes": inside[-1].rss_bytes,
                    "rss_peak_bytes": max(s.rss_bytes for s in inside),
                    "locked_bytes": inside[-1].locked_bytes,
                    "pinned_bytes": inside[-1].pinned_bytes,
                }
            )
        return width, out


async def _settled_memory(pinned_before: int, patience: float = 2.0) -> MemorySample:
    """Memory once the kernel has unpinned the ring's buffers (its exit work runs later)."""
    deadline = time.monotonic() + patience
    sample = memory_sample()
    while sample.pinned_bytes > pinned_before and time.monotonic() < deadline:
        await anyio.sleep(0.05)
        sample = memory_sample()
    return sample


async def _book(store: KVStore) -> Book:
    reply: Reply[Book] = Reply()
    return await store.runtime.binder.ask(GetBook(reply), reply)


async def run_soak(options: SoakOptions, progress: Progress | None = None) -> dict[str, Any]:
    """Run the soak; returns its JSON document (``ok`` says whether it passed)."""
    options.check()
    base = options.workdir or default_cache_dir()
    base.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="soak-", dir=base))
    try:
        return await _run_in(options, folder, progress)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def _run_in(options: SoakOptions, folder: Path, progress: Progress | None) -> dict[str, Any]:
    config = soak_config(options, folder)
    policy = FaultPolicy(options.fault_rate, seed=options.seed, slow_s=0.001)
    log = FaultLog(history=10_000)

    def wrap(target: Target) -> Target:
        return FaultyTarget(target, policy, log=log)

    def page_cache_file(path: Path, size: int) -> FaultyPageCacheFile:
        return FaultyPageCacheFile(path, size, policy, log)

    fds_before, threads_before = open_fds(), live_threads()
    pinned_before = memory_sample().pinned_bytes
    sample_s = options.sample_s or min(5.0, options.seconds / 12)
    start = time.monotonic()
    sampler = _Sampler(start)
    sampler.take()
    async with open_store(
        config, device="cpu", wrap_direct=wrap, page_cache_file=page_cache_file
    ) as store:
        soak = Soak(store, log, options, start + options.seconds)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sampler.run, sample_s, progress, soak)
            await soak.run_workers()
            sampler.take()
            tg.cancel_scope.cancel()
        elapsed = time.monotonic() - start
        book = await _book(store)
        buffers = store.runtime.buffers
        injected = {kind.value: n for kind, n in log.counts().items()}
    leaked_fds = describe_fds(open_fds() - fds_before)
    leaked_threads = sorted(live_threads() - threads_before)
    busy_buffers = sum(b.inflight for b in buffers) + sum(not b.closed for b in buffers)
    after = await _settled_memory(pinned_before)
    return _document(
        options,
        soak.ledger,
        injected,
        sampler,
        sample_s,
        elapsed,
        leaks={
            "fds": leaked_fds,
            "threads": leaked_threads,
            "buffers_busy_or_open": busy_buffers,
            "extents_held": len(book.extents),
            "files_held": sum(len(files) for files in book.files.values()),
            "locked_bytes_after": after.locked_bytes,
            "pinned_bytes_before": pinned_before,
            "pinned_bytes_after": after.pinned_bytes,
        },
    )


def _document(
    options: SoakOptions,
    ledger: Ledger,
    injected: dict[str, int],
    sampler: _Sampler,
    sample_s: float,
    elapsed: float,
    leaks: dict[str, Any],
) -> dict[str, Any]:
    attributed = ledger.attributed()
    unattributed = {
        kind.value: injected.get(kind.value, 0) - attributed.get(kind.value, 0)
        for kind in FaultKind
    }
    faults_ok = (
        not any(unattributed.values()) and not ledger.swallowed and not ledger.unexpected_count
    )
    width, windows = sampler.windows(options.seconds, slack=sample_s * 0.5)
    growth = None
    if len(windows) >= 2:
        first = windows[0]["rss_bytes"]
        growth = (windows[-1]["rss_bytes"] - first) / first
    growth_checked = options.seconds >= 120 and growth is not None
    growth_ok = not growth_checked or (growth is not None and growth < options.max_rss_growth)
    leaks_ok = not (
        leaks["fds"]
        or leaks["threads"]
        or leaks["buffers_busy_or_open"]
        or leaks["extents_held"]
        or leaks["files_held"]
        or leaks["pinned_bytes_after"] > leaks["pinned_bytes_before"]
    )
    ok = ledger.mismatches == 0 and faults_ok and leaks_ok and growth_ok
    hard = [k.value for k in FaultKind if k.hard]
    return {
        "ok": ok,
        "seconds": round(elapsed, 1),
        "contexts": options.contexts,
        "seed": options.seed,
        "policy": options.policy,
        "fault_rate": options.fault_rate,
        "cancel_rate": options.cancel_rate,
        "operations": dict(ledger.ops),
        "contexts_opened": ledger.contexts,
        "bytes_written": ledger.bytes_written,
        "bytes_verified": ledger.bytes_verified,
        "mismatches": ledger.mismatches,
        "mismatch_examples": ledger.mismatch_examples,
        "cancellations": ledger.cancellations,
        "errors_by_type": dict(ledger.errors),
        "lost_layer_refusals": ledger.lost_refusals,
        "faults": {
            "injected": injected,
            "injected_hard": sum(injected.get(k, 0) for k in hard),
            "surfaced": dict(ledger.surfaced),
            "coalesced_into_one_error": dict(ledger.coalesced),
            "during_cancellation": dict(ledger.during_cancel),
            "absorbed_short_or_slow": dict(ledger.absorbed),
            "swallowed": dict(ledger.swallowed),
            "unattributed": unattributed,
            "attributed_by_path": dict(ledger.by_path),
            "by_type": {
                kind.value: {
                    "injected": injected.get(kind.value, 0),
                    "surfaced": ledger.surfaced.get(kind.value, 0),
                    "coalesced": ledger.coalesced.get(kind.value, 0),
                    "during_cancellation": ledger.during_cancel.get(kind.value, 0),
                    "absorbed": ledger.absorbed.get(kind.value, 0),
                    "swallowed": ledger.swallowed.get(kind.value, 0),
                }
                for kind in FaultKind
            },
            "unexpected_errors": ledger.unexpected_count,
            "unexpected_examples": ledger.unexpected,
            "accounted": faults_ok,
        },
        "memory": {
            "window_s": round(width, 1),
            "windows": windows,
            "rss_growth_first_to_last": None if growth is None else round(growth, 4),
            "rss_growth_checked": growth_checked,
            "max_rss_growth": options.max_rss_growth,
        },
        "leaks": leaks,
    }
