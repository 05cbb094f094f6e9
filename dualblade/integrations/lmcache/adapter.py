"""``DualBladeL2Adapter``: a dualblade store behind LMCache's ``L2AdapterInterface``.

Load it in LMCache's multiprocess server (or ``lmcache bench l2``, or
``python -m lmcache.v1.basic_check --mode test_l2_adapter``) with::

    {"type": "plugin", "module_path": "dualblade.integrations.lmcache",
     "class_name": "DualBladeL2Adapter", "adapter_params": {...}}

(``adapter_params``: :mod:`.params`). How it runs: the adapter owns one thread with an event loop
(an anyio blocking portal), and the store, with its actors and its io_uring ring thread, runs on
that loop. LMCache's controller threads never wait on I/O, nor on the loop: each ``submit_*``
takes a task id and hands the work to the loop (:mod:`.task_inbox`; no thread per request, a
task per key there, and the ring's queue depth bounds what is in flight), and the loop records
the result and signals the kind's eventfd. Objects map to store contexts (:mod:`.object_store`),
so the store's budget places each one on the page-cache path or the direct path, and evicting
or deleting one TRIMs its blocks.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import AsyncIterator, Callable, Hashable, Mapping
from pathlib import Path
from typing import Any

import anyio
import torch
from anyio.from_thread import start_blocking_portal
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface

from dualblade import event_loop
from dualblade.collector import freeze_setup
from dualblade.integrations.lmcache.completions import Completions
from dualblade.integrations.lmcache.l1_memory import (
    free_memory,
    l1_region,
    populate_within,
    untouched_bytes,
)
from dualblade.integrations.lmcache.object_store import ObjectStore, Placement
from dualblade.integrations.lmcache.params import AdapterSetup, resolve_params
from dualblade.integrations.lmcache.process_tuning import ProcessTuning
from dualblade.integrations.lmcache.stats import AdapterStats, collect_stats
from dualblade.integrations.lmcache.striped_shares import StripedShares
from dualblade.integrations.lmcache.task_inbox import TaskInbox
from dualblade.logs import get_logger
from dualblade.pipeline import discover_memory
from dualblade.store import open_store

_log = get_logger(__name__)


def _untouched(region: tuple[int, int] | None) -> Callable[[], int] | None:
    """How much of ``region`` (address, size) is untouched now, as a callable; None for no
    region."""
    if region is None:
        return None
    address, size = region
    return lambda: untouched_bytes(address, size)


class AdapterClosedError(RuntimeError):
    """A task was submitted to an adapter after ``close()``."""


class DualBladeL2Adapter(L2AdapterInterface):  # type: ignore[misc]
    """An LMCache L2 adapter whose storage is a dualblade store (see the module docstring).

    Args:
        adapter_params: the plugin spec's ``adapter_params`` (:mod:`.params`); None or ``{}``
            runs the embedded default on a file under the user's cache directory.
        l1_memory_desc: LMCache's description of its L1 memory: made resident at the start
            (``populate_l1``), and the part of it not touched yet is kept out of the page-cache
            budget (:mod:`.l1_memory`).
        wrap_direct, page_cache_file: passed to :func:`dualblade.open_store` (fault injection
            in tests: :mod:`dualblade.testing`).

    Raises:
        AdapterParamsError: bad ``adapter_params``; the message names the key.
        ConfigError, TargetError, IoUringUnavailableError: the store cannot run here.
    """

    def __init__(
        self,
        adapter_params: Mapping[str, Any] | None = None,
        l1_memory_desc: Any = None,
        *,
        wrap_direct: Callable[[Any], Any] | None = None,
        page_cache_file: Callable[[Path, int], Any] | None = None,
    ) -> None:
        setup = resolve_params(adapter_params)
        super().__init__(max_capacity_bytes=setup.capacity)
        self.setup: AdapterSetup = setup
        self._completions = Completions()
        self._state = threading.Lock()
        self._closed = False
        self._closing = False  # set on the loop: later tasks fail at once
        self._ops: set[anyio.CancelScope] = set()
        self._idle: anyio.Event | None = None  # set when the last task ends, while closing
        self._last_stats: AdapterStats | None = None
        region = l1_region(l1_memory_desc)
        if region is not None and setup.populate_l1:
            # Before the store opens: its budget then counts L1 as in use from the start.
            why_not = populate_within(*region, free_memory(discover_memory()))
            if why_not is not None:
                _log.warning("lmcache L1 not made resident", bytes=region[1], error=why_not)
        # One object in every capacity / budget, spread over the store order, is admitted to
        # the page cache while the budget has room (StripedShares: objects stored together are
        # loaded together, and a load then reads from both paths at once), and objects stay
        # where they were placed. The store's default (fair shares, re-planned live)
        # suits requests that read every layer every step; an L2 object is written once and
        # read a few times, so moving it costs as much as the reads it would speed up. Under a
        # memory cgroup here the budget's readings swung enough that re-planning made about 210
        # moves (a read and a write each) while 512 objects were stored, and loads hit the page
        # cache 15-19 % of the time; admitted by the budget and never moved, 83 %.
        # adapter_params.replan = true turns live re-planning back on.
        store_options: dict[str, Any] = {
            "device": "cpu",
            "wrap_direct": wrap_direct,
            "share_policy": StripedShares(setup.capacity),
            "replan": setup.replan,
            # LMCache's L1 that it has not touched yet is no room for the page cache; asked at
            # every reading, so that L1 is counted once as LMCache fills it (.l1_memory).
            "reserved_memory": _untouched(region),
        }
        if page_cache_file is not None:
            store_options["page_cache_file"] = page_cache_file
        exits = contextlib.ExitStack()
        try:
            self._portal = exits.enter_context(
                start_blocking_portal(
                    "asyncio", event_loop.backend_options(), name="dualblade-lmcache"
                )
            )
            # The store's host copies run on this thread, one object's K or V (~512 KiB) at a
            # time with many in flight. torch's OpenMP pool would split each copy over every
            # core and leave its workers spinning after it, taking the cores the ring thread
            # and LMCache's threads need: loads ran 2.5x slower, at 3x the CPU per byte, on a
            # 2-core machine. The setting is this thread's own (OpenMP keeps it per thread).
            self._portal.call(torch.set_num_threads, 1)
            store = exits.enter_context(
                self._portal.wrap_async_context_manager(open_store(setup.config, **store_options))
            )
            self._inbox = TaskInbox()
            self._portal.start_task(self._inbox.serve)
        except BaseException:
            exits.close()
            self._completions.close()
            setup.remove_scratch()
            raise
        self._exits = exits
        self.objects = ObjectStore(store, setup.geometry, setup.capacity, self._evicted)
        if setup.freeze_gc:
            # Every object alive now (torch, LMCache, the store: about 300 thousand here) is
            # left out of the cyclic collector's later passes. The transfers in flight keep
            # enough objects alive that it ran a full pass every few rounds of loads, and a
            # full pass over all of them took about 300 ms on the event loop, stalling every
            # transfer (docs/lmcache.md). The cost: a reference cycle among those objects that
            # becomes garbage later is never collected.
            freeze_setup()
        # The objects made later (each stored object's context, say) are the collector's
        # again: its passes are made rarer while the adapter runs, and the GIL changes hands
        # sooner (process_tuning); the host process's settings come back when it closes.
        self._host_tuning = ProcessTuning(setup.gc_threshold, setup.switch_interval).apply()
        _log.info(
            "lmcache adapter open",
            capacity=setup.capacity,
            object_size=setup.geometry.max_object_bytes,
            direct=str(setup.config.storage.direct.path),
            policy=setup.config.policy,
        )

    # -- event fds -------------------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._completions.stores.fd

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._completions.lookups.fd

    def get_load_event_fd(self) -> int:
        return self._completions.loads.fd

    # -- submissions (LMCache's threads) ---------------------------------------------------------
    def _submit(self, body: Callable[..., Any], *args: Any) -> int:
        with self._state:
            if self._closed:
                raise AdapterClosedError("this DualBladeL2Adapter is closed")
            task_id = self._completions.next_id()
            self._inbox.submit(body, task_id, *args)
        return task_id

    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
        return self._submit(self._store, list(keys), list(objects))

    def pop_completed_store_tasks(self) -> dict[int, Any]:
        return self._completions.pop_all(self._completions.stores)

    def submit_lookup_and_lock_task(
        self, keys: list[Any], group_layout_descs: Mapping[int, Any] | None = None
    ) -> int:
        return self._submit(self._lookup, list(keys))

    def query_lookup_and_lock_result(self, task_id: int) -> Any:
        return self._completions.take(self._completions.lookups, task_id)

    def submit_unlock(self, keys: list[Any]) -> None:
        with self._state:
            if self._closed:
                return  # nothing is locked any more
            self._inbox.submit(self.objects.unlock, list(keys))

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        return self._submit(self._load, list(keys), list(objects))

    def query_load_result(self, task_id: int) -> Any:
        return self._completions.take(self._completions.loads, task_id)

    def delete(self, keys: list[Any]) -> None:
        """Delete ``keys`` now (LMCache's eviction): they are gone from lookups when this
        returns, and their blocks are trimmed (or their files unlinked) once no load reads them.
        """
        with self._state:
            if self._closed:
                return
        # Not under the lock: LMCache's listeners, told on the loop, may call back in.
        with contextlib.suppress(RuntimeError):  # closed meanwhile: the portal has stopped
            self._portal.call(self._delete, list(keys))

    # -- on the loop -----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _op(self, what: str) -> AsyncIterator[bool]:
        """Run one task's body: yields False once the adapter is closing (the body then reports
        a failure without touching the store); a close cancels it; an unexpected error is
        logged, so that the task still reports and LMCache is not left waiting."""
        if self._closing:
            yield False
            return
        with anyio.CancelScope() as scope:
            self._ops.add(scope)
            try:
                yield True
            except Exception:
                _log.exception("lmcache adapter task failed", task=what)
            finally:
                self._ops.discard(scope)
                if not self._ops and self._idle is not None:
                    self._idle.set()

    async def _store(self, task_id: int, keys: list[Any], objects: list[Any]) -> None:
        result = L2StoreResult(False, 0)
        try:
            async with self._op("store") as running:
                if running:
                    sizes = await self.objects.put_many(keys, objects)
                    stored = [(k, s) for k, s in zip(keys, sizes, strict=True) if s]
                    if stored:
                        self._notify_keys_stored([k for k, _ in stored], [s for _, s in stored])
                    # one failed key fails the task: LMCache then keeps all of them in L1
                    ok = all(s is not None for s in sizes)
                    result = L2StoreResult(ok, sum(s or 0 for s in sizes))
        finally:
            self._completions.finish(self._completions.stores, task_id, result)

    async def _lookup(self, task_id: int, keys: list[Any]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            async with self._op("lookup") as running:
                if running:
                    for i, found in enumerate(self.objects.lookup_and_lock(keys)):
                        if found:
                            bitmap.set(i)
        finally:
            self._completions.finish(self._completions.lookups, task_id, bitmap)

    async def _load(self, task_id: int, keys: list[Any], objects: list[Any]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            async with self._op("load") as running:
                if running:
                    landed = await self.objects.get_many(keys, objects)
                    for i, ok in enumerate(landed):
                        if ok:
                            bitmap.set(i)
                    hits = [k for k, ok in zip(keys, landed, strict=True) if ok]
                    if hits:
                        self._notify_keys_accessed(hits)
        finally:
            self._completions.finish(self._completions.loads, task_id, bitmap)

    async def _delete(self, keys: list[Any]) -> None:
        async with self._op("delete") as running:
            if running:
                gone = await self.objects.remove(keys, evicted=False)
                if gone:
                    self._notify_keys_deleted([e.key for e in gone], [e.size for e in gone])

    def _evicted(self, keys: list[Hashable], sizes: list[int]) -> None:
        self._notify_keys_deleted(keys, sizes)

    async def _shutdown(self) -> None:
        # Submitted before close() took the lock, so queued on the loop before this ran: every
        # such task has started (or fails at once in _op, seeing _closing) by now.
        self._closing = True
        if self._ops:
            self._idle = anyio.Event()
            for scope in list(self._ops):
                scope.cancel()
            await self._idle.wait()
        self._inbox.stop()
        await self.objects.close()
        self._last_stats = collect_stats(self)

    def placement(self, key: Any) -> Placement | None:
        """Where the object of ``key`` was placed when stored (None: not held): the medium, and
        on the direct path the target's byte range it occupies."""
        result: Placement | None = self._portal.call(self.objects.placement, key)
        return result

    def direct_ranges(self) -> list[tuple[int, int]]:
        """The direct target's byte ranges ``(start, end)`` that the objects held on the direct
        path occupy now, in order, adjacent ones merged (the target is
        ``setup.config.storage.direct.path``)."""
        result: list[tuple[int, int]] = self._portal.call(self.objects.direct_ranges)
        return result

    # -- observing -------------------------------------------------------------------------------
    def stats(self) -> AdapterStats:
        """A typed snapshot: the adapter's objects, hits and failures, and its store's stats.
        After ``close()``, the last one."""
        if self._last_stats is None:
            with contextlib.suppress(RuntimeError):  # closed meanwhile: the portal has stopped
                return self._portal.call(collect_stats, self)
        if self._last_stats is None:
            raise AdapterClosedError("this DualBladeL2Adapter failed to close; it has no stats")
        return self._last_stats

    def metrics(self) -> dict[str, Any]:
        """:meth:`stats` as a JSON-ready dict."""
        return self.stats().to_dict()

    def report_status(self) -> dict[str, Any]:
        """LMCache's status report: healthy while open, with the metrics."""
        closed = self._closed
        return {"is_healthy": not closed, "type": type(self).__name__, **self.metrics()}

    # -- closing ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Cancel the tasks in flight (each reports a failure), release every object (TRIM,
        unlink), stop the store and the loop thread, close the eventfds and remove the scratch
        folder. Idempotent."""
        with self._state:
            if self._closed:
                return
            self._closed = True
        try:
            self._portal.call(self._shutdown)
        finally:
            self._exits.close()
            self._completions.close()
            self.setup.remove_scratch()
            self._host_tuning.apply()
        if self.setup.stats_file is not None and self._last_stats is not None:
            self._write_stats(self.setup.stats_file, self._last_stats)

    @staticmethod
    def _write_stats(path: Path, stats: AdapterStats) -> None:
        """The last stats as JSON (``stats_file``): LMCache's server and ``lmcache bench``
        run the adapter in their own process, and this is how a reader outside gets them."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(stats.to_dict(), indent=2, default=str) + "\n")
        except OSError as error:
            _log.warning("cannot write the adapter's stats", path=str(path), error=str(error))
