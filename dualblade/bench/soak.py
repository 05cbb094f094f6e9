r"""The soak: many concurrent contexts, random faults and cancellations, every byte checked.

A store runs on a direct file (in a scratch folder it removes afterwards) wrapped in a
:class:`~dualblade.testing.FaultyTarget`, with page-cache files that are
:class:`~dualblade.testing.FaultyPageCacheFile`\ s, so faults hit both paths (not the
baseline's memory map, which bypasses the engine). ``contexts`` workers each open a context
after another and drive it with random writes (prefills), appends (decode steps) and reads, some
cancelled at a random moment, and compare every byte read with what the context stored. Every
injected fault is accounted to the operation it hit; a swallowed fault, an error nobody
injected, or a fault in no one's storage fails the soak.

Resident and pinned memory are sampled all along; the growth of RSS is measured between the
end of the first window (allocations at steady state) and the end of the last. Afterwards the
process must hold no more file descriptors or threads than before, no buffer may be under I/O
and the store must hold no extent or file.

The parts: :mod:`.soak_options` (what to run, on which store), :mod:`.soak_worker` (the workers
and their sessions), :mod:`.soak_ledger` (what they observed, and how a fault is accounted),
:mod:`.soak_memory` (the sampler) and :mod:`.soak_report` (the JSON document and its verdict).
Two modes change where the store runs: ``full_disk`` puts the folder on a small tmpfs
(:mod:`.soak_disk`), ``kill_restart`` runs the store in child processes that are killed and
restarted (:mod:`.soak_restart`, :mod:`.soak_child`).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import anyio

from dualblade.bench.process_stats import (
    MemorySample,
    describe_fds,
    live_threads,
    memory_sample,
    open_fds,
)
from dualblade.bench.soak_disk import DiskFiller, full_disk_bytes, small_file_system
from dualblade.bench.soak_memory import MemorySampler, settled_memory
from dualblade.bench.soak_options import SoakOptions, soak_config
from dualblade.bench.soak_pressure import PressureLog, squeeze
from dualblade.bench.soak_report import soak_document
from dualblade.bench.soak_worker import Soak
from dualblade.io_engine import Target
from dualblade.pipeline import default_cache_dir
from dualblade.store import KVStore, open_store
from dualblade.testing import FaultLog, FaultPolicy, FaultyPageCacheFile, FaultyTarget

Progress = Callable[[str], None]


async def run_soak(options: SoakOptions, progress: Progress | None = None) -> dict[str, Any]:
    """Run the soak; returns its JSON document (``ok`` says whether it passed).

    Raises:
        ConfigError: the options cannot run.
    """
    options.check()
    base = options.workdir or default_cache_dir()
    base.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if options.full_disk:
            base = stack.enter_context(small_file_system(base, full_disk_bytes(options)))
        folder = Path(tempfile.mkdtemp(prefix="soak-", dir=base))
        stack.callback(shutil.rmtree, folder, ignore_errors=True)
        if options.kill_restart:
            from dualblade.bench.soak_restart import run_kill_restart

            return await run_kill_restart(options, folder, progress)
        return await run_in_folder(options, folder, progress)


class SoakObserver(Protocol):
    """Watches a soak from inside (the kill-restart mode's child process reports through it)."""

    def opened(self, store: KVStore) -> None:
        """The store is open, before any context."""

    def sampled(self, soak: Soak, faults: FaultLog, sample: MemorySample) -> None:
        """Called every sample, after a mismatch or an unexpected error, and at the end."""


async def run_in_folder(
    options: SoakOptions,
    folder: Path,
    progress: Progress | None,
    observer: SoakObserver | None = None,
) -> dict[str, Any]:
    """The soak on a store in ``folder`` (which the caller removes); returns its document."""
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
    sampler = MemorySampler(start)
    sampler.take()
    pressure = PressureLog()
    # Live re-planning only under --pressure (which runs without faults): otherwise each fault
    # must land on one context's own operation, and a layer move is the store's.
    async with open_store(
        config,
        device="cpu",
        wrap_direct=wrap,
        page_cache_file=page_cache_file,
        replan=options.pressure,
    ) as store:
        soak = Soak(store, log, options, start + options.seconds)
        if observer is not None:
            observer.opened(store)
            soak.ledger.on_problem = lambda: observer.sampled(soak, log, memory_sample())

        def report(elapsed: float, sample: MemorySample) -> None:
            if options.pressure:
                soak.pressure = pressure.to_dict(store)
            if progress is not None:
                progress(soak.status(elapsed, sample.rss_bytes))
            if observer is not None:
                observer.sampled(soak, log, sample)

        async with anyio.create_task_group() as tg:
            tg.start_soon(sampler.run, sample_s, report)
            if options.full_disk:
                tg.start_soon(DiskFiller(folder, options.seed).run)
            if options.pressure:
                tg.start_soon(squeeze, store, options.seed, pressure)
            await soak.run_workers()
            last = sampler.take()
            tg.cancel_scope.cancel()
        if options.pressure:
            soak.pressure = pressure.to_dict(store)
        if observer is not None:
            observer.sampled(soak, log, last)
        elapsed = time.monotonic() - start
        held = store.stats()  # what the contexts still hold, all of them closed
        squeezed = pressure.to_dict(store) if options.pressure else None
        injected = {kind.value: n for kind, n in log.counts().items()}
    leaked_fds = describe_fds(open_fds() - fds_before)
    leaked_threads = sorted(live_threads() - threads_before)
    closed = store.stats()  # the buffers as the store left them
    busy_buffers = closed.buffers_in_flight + closed.buffers_open
    after = await settled_memory(pinned_before)
    return soak_document(
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
            "extents_held": held.extents_held,
            "files_held": held.files_held,
            "locked_bytes_after": after.locked_bytes,
            "pinned_bytes_before": pinned_before,
            "pinned_bytes_after": after.pinned_bytes,
            "ledger_placed_bytes": held.ledger.placed_bytes,
        },
        pressure=squeezed,
    )
