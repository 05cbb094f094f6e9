"""One (policy, limit) run of the sweep, in a process of its own inside its memory cgroup.

Run as ``python -m dualblade.bench.sweep_worker SPEC.json``; the spec names the cgroup, the
pipeline config (a mapping), the policy, the steps and where to write the result. The process
joins the cgroup *first*, before torch is imported, so that everything it maps or caches from then
on is charged to the limit under test. The budgeter then discovers that limit like any user's
process would: nothing is told the limit but the kernel.

The result JSON holds the workload's latencies, the path split, hit rates, the device's activity
per phase (``/sys/block/*/stat``), request-level metrics from the ring's submission log, the read
throughput sampled every 100 ms through decode, the strategy per step and the cgroup's peak.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from dualblade.bench.worker_process import run_worker

if TYPE_CHECKING:
    from dualblade.telemetry import Tracer

THROUGHPUT_INTERVAL = 0.1


async def _sample_reads(store: Any, samples: list[tuple[float, int]]) -> None:
    import time

    import anyio

    while True:
        samples.append((time.perf_counter(), sum(store.stats().read_bytes.values())))
        await anyio.sleep(THROUGHPUT_INTERVAL)


def _timeline(samples: list[tuple[float, int]], start: float, end: float) -> list[list[float]]:
    """``[seconds since decode start, read bytes/s]`` per sampling interval within decode."""
    out = []
    inside = [s for s in samples if start <= s[0] <= end]
    for (t0, b0), (t1, b1) in itertools.pairwise(inside):
        if t1 > t0:
            out.append([round(t1 - start, 3), round((b1 - b0) / (t1 - t0))])
    return out


class _Capture:
    """The store as the OPT engine's KV provider, keeping the context the engine opens: the
    floor's passes read that context's storage after the last token, before it closes."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.contexts: list[Any] = []

    @property
    def read_parallelism(self) -> int:
        return int(self._store.read_parallelism)

    def iteration(self) -> Any:
        return self._store.iteration()

    def metrics(self) -> dict[str, Any]:
        return dict(self._store.metrics())

    @contextlib.asynccontextmanager
    async def context(self) -> AsyncIterator[Any]:
        async with self._store.context() as ctx:
            self.contexts.append(ctx)
            yield ctx


async def _run_model(
    store: Any, spec: dict[str, Any], model: Any, on_phase: Any, after_decode: Any
) -> Any:
    """Real inference (``spec["compute"]``): the OPT engine generates with its KV in ``store``.

    The phases are marked where the engine's stream yields: prefill ends with the first token,
    decode with the last one. So the disk statistics and counters of each phase cover that
    phase alone (they covered the whole run in both before). ``after_decode`` runs at the last
    token, while the engine's context is still open.
    """
    import time

    from dualblade.bench.sweep_workload import PhaseClock, SweepWorkloadResult
    from dualblade.models import random_prompts

    workload = store.config.workload
    prompts = random_prompts(
        workload.batch, workload.prompt_len, model.arch.vocab_size, spec.get("seed", 0)
    )
    clock = PhaseClock()
    times: list[float] = []
    tokens_wanted = spec["decode_steps"] + 1
    provider = _Capture(store)
    on_phase("prefill_start")
    clock.prefill_start = start = time.perf_counter()
    stream = model.stream(prompts, tokens_wanted, provider)
    async with contextlib.aclosing(stream) as tokens:
        async for _token in tokens:
            now = time.perf_counter()
            times.append(now - start)
            start = now
            if len(times) == 1:  # the first token: prefill is over
                clock.prefill_end = clock.decode_start = now
                on_phase("prefill_end")
                on_phase("decode_start")
            if len(times) == tokens_wanted:  # the last token: decode is over
                clock.decode_end = now
                on_phase("decode_end")
                await after_decode(provider.contexts[-1])
    return SweepWorkloadResult(
        times[0],
        sum(times[1:]),
        times[1:],
        ["n/a"] * len(times[1:]),
        0,
        clock,
    )


def _build_model(spec: dict[str, Any]) -> Any:
    from dualblade.models import build_model, compute_dtype

    compute = spec["compute"]
    return build_model(
        preset=compute["preset"],
        seed=compute.get("seed", 0),
        device=spec.get("device") or "cpu",
        dtype=compute_dtype(compute.get("dtype", "float32")),
    )


async def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the spec's workload and gather every metric of the run; with ``spec["trace"]``,
    write the run's trace there (a failed run's too: it shows where the run stopped)."""
    from dualblade.telemetry import Tracer

    tracer = Tracer(enabled=bool(spec.get("trace")))
    try:
        return await _run(spec, tracer)
    finally:
        if spec.get("trace"):
            tracer.write(spec["trace"])


async def _run(spec: dict[str, Any], tracer: Tracer) -> dict[str, Any]:
    import anyio

    from dualblade.bench.disk_stats import DiskSnapshot, activity, read_snapshot, stat_file_for
    from dualblade.bench.floor import FloorRates, measure_floor_rates
    from dualblade.bench.process_stats import storage_read_bytes
    from dualblade.bench.request_log import (
        RequestLog,
        latency_percentiles,
        queue_depth_bins,
        sequentiality,
    )
    from dualblade.bench.sweep_workload import derive_kv, read_buffers, run_sweep_workload
    from dualblade.collector import CollectorPauses, freeze_setup
    from dualblade.errors import DualbladeError
    from dualblade.pipeline import config_from_mapping
    from dualblade.store import open_store

    config = config_from_mapping(spec["config"], source="bench spec", env={})
    stat_file = stat_file_for(spec["device_path"]) if spec.get("device_path") else None
    # Made before the store opens, as an application loads its model first: the budgeter then
    # counts it as memory in use.
    model = _build_model(spec) if spec.get("compute") else None
    data = None if model is not None else derive_kv(config, spec.get("seed", 0))
    import torch

    device = spec.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    buffers = None if model is not None else read_buffers(config, device)
    floor_memory = _floor_memory(config, buffers)
    floor_rates: list[FloorRates] = []
    floor_errors: list[str] = []
    log = RequestLog()
    samples: list[tuple[float, int]] = []
    if model is not None:
        model.tracer = tracer  # the engine's steps and layers, beside the store's actors
    async with open_store(config, device=device, tracer=tracer) as store:
        store.observe_chunks(log)
        freeze_setup()  # the model, its data and the store live as long as the run
        disk: dict[str, DiskSnapshot] = {}
        counters: dict[str, dict[str, Any]] = {}

        def on_phase(mark: str) -> None:
            stats = store.stats()
            counters[mark] = {
                "read_bytes": dict(stats.read_bytes),
                "write_bytes": dict(stats.write_bytes),
                "cache_lookup_bytes": stats.cache_lookup_bytes,
                "cache_hit_bytes": stats.cache_hit_bytes,
                "storage_read_bytes": storage_read_bytes(),
            }
            if stat_file is not None:
                disk[mark] = read_snapshot(stat_file)

        async def after_decode(ctx: Any) -> None:
            try:
                floor_rates.append(await measure_floor_rates(store, ctx, floor_memory))
            except (DualbladeError, OSError, ValueError) as error:
                floor_errors.append(f"the floor's passes failed: {type(error).__name__}: {error}")

        with CollectorPauses(tracer) as pauses:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_sample_reads, store, samples)
                if model is not None:
                    result = await _run_model(store, spec, model, on_phase, after_decode)
                else:
                    result = await run_sweep_workload(
                        store,
                        decode_steps=spec["decode_steps"],
                        data=data,
                        buffers=buffers,
                        verify=spec.get("verify", "sample"),
                        on_phase=on_phase,
                        after_decode=after_decode,
                    )
                tg.cancel_scope.cancel()
        metrics = store.metrics()
        # the moves the re-planner made: a demotion in a single-context run means the budget
        # fell under the plan the context was opened with (docs/bench.md, thirtieth session)
        ledger = store.stats().ledger.to_dict()
        placement = store.plan.placement
        budget = store.plan.budget.to_dict()
    clock = result.clock
    decode_log = log.records(clock.decode_start, clock.decode_end)
    prefill_log = log.records(clock.prefill_start, clock.prefill_end)
    window = config.copy_threads
    report: dict[str, Any] = {
        "policy": config.policy,
        "compute": spec.get("compute"),
        "prefill_s": result.prefill_s,
        "prefill_produce_s": result.prefill_produce_s,
        "decode_s": result.decode_s,
        "decode_step_s": result.decode_step_s,
        "strategy": metrics["strategy"],
        "strategies_by_step": result.strategies,
        "verified_bytes": result.verified_bytes,
        "page_cache_budget_bytes": metrics["page_cache_budget_bytes"],
        "budget": budget,
        "ledger": ledger,
        # The context's own plan (a later budget change re-plans only new contexts); with
        # --compute the context is the model's, and the store's plan at the end stands in.
        "path_split": {
            "page_cache_layers": (
                result.placement[0] if result.placement else list(placement.page_cache)
            ),
            "direct_layers": result.placement[1] if result.placement else list(placement.direct),
            "source": "context plan" if result.placement else "store plan at the end",
        },
        "requests": {
            "prefill": {
                "count": len(prefill_log),
                "latency": latency_percentiles(prefill_log),
                "sequentiality": sequentiality(prefill_log, window),
            },
            "decode": {
                "count": len(decode_log),
                "latency": latency_percentiles(decode_log),
                "sequentiality": sequentiality(decode_log, window),
                "by_queue_depth": queue_depth_bins(decode_log),
            },
        },
        "decode_throughput": _timeline(samples, clock.decode_start, clock.decode_end),
        "decode_step_ends_s": [round(t - clock.decode_start, 3) for t in clock.step_ends],
        # the collector's passes, each holding the GIL (dualblade.collector.CollectorPauses)
        "python_gc": {
            "prefill": pauses.between(clock.prefill_start, clock.prefill_end),
            "decode": pauses.between(clock.decode_start, clock.decode_end),
        },
    }
    report.update(_phase_bytes(counters))
    report.update(_floor(report, floor_rates, floor_errors))
    if disk:
        report["disk"] = {
            phase: activity(disk[f"{phase}_start"], disk[f"{phase}_end"]).to_dict()
            for phase in ("prefill", "decode")
        }
    return report


def _floor_memory(config: Any, buffers: list[Any] | None) -> list[Any]:
    """Host memory for the floor's passes: the workload's own read buffers where they are
    host memory (the reads land where the decode's did), else one KPU-sized aligned buffer,
    made and touched now, before the store opens, so the budgeter counts it as in use."""
    from dualblade.io_engine import DIRECT_FILE_ALIGNMENT, AlignedBuffer

    landings = [b.landings[0] for b in buffers or []]
    if landings and all(landing is not None for landing in landings):
        return [landing.buffer for landing in landings]
    row = config.shape().row_bytes(config.workload.batch)
    stride = -(-row // DIRECT_FILE_ALIGNMENT) * DIRECT_FILE_ALIGNMENT
    buffer = AlignedBuffer(config.workload.max_len * stride)
    buffer.tensor().zero_()
    return [buffer]


def _floor(report: dict[str, Any], rates: list[Any], errors: list[str]) -> dict[str, Any]:
    """``floor_s``, ``floor_serial_s``, ``floor_ratio`` (decode / floor) and the floor's parts
    (see :mod:`dualblade.bench.floor`)."""
    from dualblade.bench.floor import DecodeReads, decode_floor

    if not rates:
        error = errors[0] if errors else "the floor was not measured"
        return {"floor_s": None, "floor_serial_s": None, "floor_ratio": None, "floor_error": error}
    reads = report["decode_read_bytes"]
    decode_reads = DecodeReads(
        direct=reads.get("direct", 0),
        page_cache=reads.get("page-cache", 0) + reads.get("baseline", 0),
        resident=report["decode_resident_bytes"],
    )
    floor = decode_floor(decode_reads, rates[0])
    floor_s = floor["floor_s"]
    floor["floor_ratio"] = report["decode_s"] / floor_s if floor_s else None
    return floor


def _phase_bytes(marks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Bytes read per path during decode and the hit rates.

    ``hit_rate`` is the share of all KV bytes read during decode that were resident in the page
    cache when their read was requested (``mincore`` over each whole read before it starts, so
    that readahead within a read does not count); direct reads are never hits.
    ``page_cache_path_hit_rate`` is the same over the page-cache (or mmap) path's bytes alone.
    ``decode_storage_read_bytes`` is what the whole process made the kernel fetch from storage
    (``/proc/self/io``): besides KV misses and direct reads it holds whatever else the process
    pages in, such as the CUDA libraries on their first use.
    """
    before, at_decode, after = marks["prefill_start"], marks["decode_start"], marks["decode_end"]
    reads = {
        path: after["read_bytes"].get(path, 0) - at_decode["read_bytes"].get(path, 0)
        for path in after["read_bytes"]
    }
    total = sum(reads.values())
    fetched = after["storage_read_bytes"] - at_decode["storage_read_bytes"]
    resident = after["cache_hit_bytes"] - at_decode["cache_hit_bytes"]
    looked_up = after["cache_lookup_bytes"] - at_decode["cache_lookup_bytes"]
    written = {
        path: at_decode["write_bytes"].get(path, 0) - before["write_bytes"].get(path, 0)
        for path in at_decode["write_bytes"]
    }
    return {
        "decode_read_bytes": reads,
        "prefill_write_bytes": written,
        "decode_resident_bytes": resident,
        "hit_rate": resident / total if total else 0.0,
        "page_cache_path_hit_rate": resident / looked_up if looked_up else None,
        "decode_storage_read_bytes": fetched,
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m dualblade.bench.sweep_worker SPEC.json``."""
    return run_worker(run_spec, argv)


if __name__ == "__main__":
    sys.exit(main())
