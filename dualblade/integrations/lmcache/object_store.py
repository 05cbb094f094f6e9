"""Objects by key in a dualblade store: each object is one store context, on the event loop.

Why a context per object: a context is the store's unit of placement and of release. Its plan
puts its one layer on the page-cache path or the direct path under the store-wide budget; its
direct bytes are a run of consecutive blocks claimed from the binder; and closing it TRIMs that
run (or unlinks its page-cache files). So an evicted or deleted object gives its blocks back to
the device at once, and the store's own counters (bytes per path, page-cache hits, trims) cover
every object. Everything here runs on the adapter's event-loop thread; nothing here knows
LMCache (the adapter turns its calls into these).

Failures stay with their key: a store whose write fails (an I/O error, no room) leaves its key
unstored and its storage released; a load that fails leaves its key's bytes in place for a later
try. Neither touches another key.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Coroutine, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from dualblade.integrations.lmcache.index import Entry, ObjectIndex
from dualblade.integrations.lmcache.objects import (
    KVImage,
    ObjectRegion,
    ObjectShapeError,
    exact_region,
    kv_image,
    object_bytes,
    unstage,
)
from dualblade.integrations.lmcache.params import ObjectGeometry
from dualblade.io_engine import BorrowedBuffer
from dualblade.logs import get_logger
from dualblade.pipeline import KpuId, Medium
from dualblade.store import (
    KVContext,
    KVStore,
    read_layer_straight,
    write_layer_straight,
)

_log = get_logger(__name__)

#: Rounds of evicting and retrying when concurrent stores keep taking the room just made.
_ROOM_TRIES = 16


@dataclass
class Slot:
    """An object's storage: its open context, and the context manager that closes it."""

    ctx: KVContext
    scope: contextlib.AbstractAsyncContextManager[KVContext]

    async def close(self) -> None:
        """TRIM the context's direct run or unlink its files; never interrupted."""
        with anyio.CancelScope(shield=True):
            await self.scope.__aexit__(None, None, None)


@dataclass(frozen=True)
class Placement:
    """Where an object was placed when it was stored: the medium, and on the direct path the
    byte range of the target that its K and V occupy (consecutive blocks)."""

    medium: str
    direct_bytes: tuple[int, int] | None


@dataclass
class TransferCounters:
    """What stores and loads did; only grows."""

    stored: int = 0
    stored_bytes: int = 0
    store_skipped: int = 0  # the key was there already
    store_failures: int = 0
    loads: int = 0
    load_hits: int = 0
    load_bytes: int = 0
    load_failures: int = 0


def _check_load_size(held: int, stored: int) -> None:
    """A load buffer must hold exactly the stored object.

    Raises:
        ObjectShapeError: it does not.
    """
    if held != stored:
        raise ObjectShapeError(f"the load buffer holds {held} bytes; the object has {stored}")


#: Told about keys the adapter let go of on its own (evictions): keys and their object sizes.
DeletedCallback = Callable[[list[Hashable], list[int]], None]


class ObjectStore:
    """Objects by key in ``store``, within ``capacity`` bytes (see the module docstring)."""

    def __init__(
        self,
        store: KVStore,
        geometry: ObjectGeometry,
        capacity: int,
        on_evicted: DeletedCallback,
    ) -> None:
        self.store = store
        self.geometry = geometry
        self.index = ObjectIndex(capacity)
        self.counters = TransferCounters()
        self._on_evicted = on_evicted

    # -- store -----------------------------------------------------------------------------------
    async def put_many(self, keys: Sequence[Hashable], objects: Sequence[Any]) -> list[int | None]:
        """Store each object under its key, all at once; per key, the bytes stored (0: it was
        there already) or None (it failed; see the log)."""
        results: list[int | None] = [None] * len(keys)

        async def one(i: int) -> None:
            results[i] = await self.put(keys[i], objects[i])

        # A task per key, the first one included: a store's first key opens a context (a plan
        # and an extent) before it writes, and run in the store's own first step it held up the
        # next stores' steps; lmcache-bench's all-direct stores ran 7 % slower that way.
        async with anyio.create_task_group() as tg:
            for i in range(len(keys)):
                tg.start_soon(one, i)
        return results

    async def put(self, key: Hashable, obj: Any) -> int | None:
        """Store one object (see :meth:`put_many`)."""
        if key in self.index:
            self.counters.store_skipped += 1
            return 0
        # Most objects are exactly their K and V rows: found without a tensor over them (see
        # exact_region); any other is staged into rows now.
        region = exact_region(obj, self.geometry)
        image: KVImage | None = None
        if region is not None:
            nbytes, rows = region.nbytes, region.rows
        else:
            try:
                flat = object_bytes(obj)
                image = kv_image(flat, self.geometry, fill=True)
            except ObjectShapeError as error:
                return self._store_failed(key, "unusable object", error)
            nbytes, rows = flat.numel(), image.rows
        footprint = 2 * rows * self.geometry.row_bytes
        if not await self._make_room(footprint):
            self.index.counters.refused_no_room += 1
            return self._store_failed(key, "no room: the capacity is locked or in flight", None)
        if key in self.index:  # stored by another task while this one made room
            self.counters.store_skipped += 1
            return 0
        entry = self.index.reserve(key, nbytes, footprint)
        slot: Slot | None = None
        try:
            slot = await self._open(rows)
            if region is None or not await self._straight(slot.ctx, region):
                if image is None:  # exact rows, but memory the target cannot take as it is
                    image = kv_image(object_bytes(obj), self.geometry, fill=True)
                await slot.ctx.write(0, image.k, image.v)
        except BaseException as error:
            if slot is not None:
                await slot.close()
            self.index.abandon(entry)
            if not isinstance(error, Exception):
                raise  # cancelled: the caller reports it
            return self._store_failed(key, "write failed", error)
        self.index.commit(entry, slot, str(slot.ctx.plan.placement.medium_of(0)))
        self.counters.stored += 1
        self.counters.stored_bytes += entry.size
        return entry.size

    def _store_failed(self, key: Hashable, why: str, error: BaseException | None) -> int | None:
        """Count and log a key that was not stored; None, the key's result."""
        self.counters.store_failures += 1
        _log.warning("object not stored", key=str(key), why=why, error=str(error or ""))
        return None

    async def _open(self, rows: int) -> Slot:
        # A smaller object gets a context of its own length, so its run and files are its size.
        scope = (
            self.store.context()
            if rows == self.geometry.max_rows
            else self.store.context(max_len=rows)
        )
        ctx = await scope.__aenter__()
        return Slot(ctx, scope)

    async def _make_room(self, footprint: int) -> bool:
        """Evict least recently used objects until ``footprint`` fits; False when it cannot
        (locked, pending and loading objects are never evicted)."""
        for _ in range(_ROOM_TRIES):
            victims = self.index.victims(footprint)
            if victims is None:
                return False
            if not victims:
                return True
            await self.remove([v.key for v in victims], evicted=True)
        return False

    # -- look up, lock, load ---------------------------------------------------------------------
    def lookup_and_lock(self, keys: Sequence[Hashable]) -> list[bool]:
        """Which keys are stored; those found are locked against eviction until unlocked."""
        return self.index.lookup_and_lock(keys)

    def unlock(self, keys: Sequence[Hashable]) -> None:
        self.index.unlock(keys)

    async def get_many(self, keys: Sequence[Hashable], objects: Sequence[Any]) -> list[bool]:
        """Load each key's bytes into its object, all at once; per key, whether it landed."""
        results = [False] * len(keys)

        async def one(i: int) -> None:
            results[i] = await self.get(keys[i], objects[i])

        await _all_at_once(len(keys), one)
        return results

    async def get(self, key: Hashable, obj: Any) -> bool:
        """Load one key into ``obj`` (see :meth:`get_many`)."""
        self.counters.loads += 1
        entry = self.index.start_read(key)
        if entry is None:
            return False
        try:
            region = exact_region(obj, self.geometry)
            if region is not None:
                _check_load_size(region.nbytes, entry.size)
            if region is None or not await self._straight(entry.slot.ctx, region, load=True):
                flat = object_bytes(obj)
                _check_load_size(flat.numel(), entry.size)
                image = kv_image(flat, self.geometry, fill=False)
                await entry.slot.ctx.read(0, out=(image.k, image.v))
                unstage(image, flat)
        except Exception as error:
            self.counters.load_failures += 1
            _log.warning("object not loaded", key=str(key), error=str(error))
            return False
        finally:
            if self.index.finish_read(entry):
                await self._release(entry)
        self.counters.load_hits += 1
        self.counters.load_bytes += entry.size
        return True

    @staticmethod
    async def _straight(ctx: KVContext, region: ObjectRegion, *, load: bool = False) -> bool:
        """Move the object's K and V straight between LMCache's memory and storage, without a
        copy thread (:mod:`dualblade.store`'s straight transfers); False where the store
        cannot (memory not aligned as the direct target needs, say), and the caller moves
        the object through the copy threads."""
        memory = BorrowedBuffer(region.owner, region.nbytes)  # K's rows, then V's
        try:
            offsets = (0, region.nbytes // 2)
            if load:
                return await read_layer_straight(ctx, 0, memory, offsets)
            return await write_layer_straight(ctx, 0, memory, offsets, region.rows)
        finally:
            memory.close()

    async def placement(self, key: Hashable) -> Placement | None:
        """Where the object of ``key`` was placed (None: no such object)."""
        entry = self.index.ready(key)
        if entry is None:
            return None
        if entry.medium != str(Medium.DIRECT):
            return Placement(entry.medium, None)
        lba_map = await entry.slot.ctx.direct_map()
        k, v = (lba_map.lookup(KpuId(0, t)) for t in ("K", "V"))
        start = min(k.byte_offset, v.byte_offset)
        return Placement(
            entry.medium, (start, max(k.byte_offset + k.nbytes, v.byte_offset + v.nbytes))
        )

    async def direct_ranges(self) -> list[tuple[int, int]]:
        """The target's byte ranges ``(start, end)`` that the objects held on the direct path
        occupy now, in order, adjacent ones merged."""
        ranges = []
        for entry in self.index.entries():
            placed = await self.placement(entry.key)
            if placed is not None and placed.direct_bytes is not None:
                ranges.append(placed.direct_bytes)
        merged: list[tuple[int, int]] = []
        for start, end in sorted(ranges):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
            else:
                merged.append((start, end))
        return merged

    # -- let go ----------------------------------------------------------------------------------
    async def remove(self, keys: Sequence[Hashable], *, evicted: bool) -> list[Entry]:
        """Take ``keys`` out (unknown ones are skipped) and release their storage, at once or
        after the loads still reading them; evictions are reported to ``on_evicted``."""
        gone = [e for e in (self.index.remove(k, evicted=evicted) for k in keys) if e is not None]
        if evicted and gone:
            self._on_evicted([e.key for e in gone], [e.size for e in gone])
        for entry in gone:
            if entry.readers == 0:
                await self._release(entry)
        return gone

    async def _release(self, entry: Entry) -> None:
        await entry.slot.close()
        self.index.released(entry)

    async def close(self) -> list[Entry]:
        """Release every stored object (call once no store or load runs); returns them."""
        gone = self.index.drain()
        for entry in gone:
            if entry.readers == 0:
                await self._release(entry)
        return gone


async def _all_at_once(count: int, one: Callable[[int], Coroutine[Any, Any, None]]) -> None:
    """``one(0)`` .. ``one(count - 1)`` at once: the first in this task, the rest in tasks.

    Why the first here: a task started now first runs in the loop's next turn, after every
    task that is ready before it. LMCache submits a round of 64 loads together, so with a task
    per key every load's first step (spawning its keys) ran before any key's read was posted,
    and the disk idled for the first 10-46 ms of each 250-300 ms round (docs/lmcache.md). Run
    here, each load's first key posts its read in the load's first step.
    """
    async with anyio.create_task_group() as tg:
        for i in range(1, count):
            tg.start_soon(one, i)
        if count:
            await one(0)
