"""Buffers registered with the ring after its first ones: their chunks go as fixed-buffer
commands, their slots come back when they are removed or collected, and a full table, compat
mode or a passthrough ring say why a buffer stays unregistered."""

from __future__ import annotations

import gc
import hashlib
import os
import threading
from collections.abc import Iterator

import pytest

from dualblade.io_engine import AlignedBuffer, DirectFile, IOEngine, Op, _fixed_buffers

pytestmark = pytest.mark.anyio

SIZE = 1 << 20


@pytest.fixture
def later_buffers() -> None:
    """Skip, saying why, where a ring takes no buffers after its first ones."""
    if (note := _fixed_buffers.memlock_note()) is not None:
        pytest.skip(f"later buffers stay unregistered in this process: {note}")
    with IOEngine(queue_depth=4, compat="off") as asked, AlignedBuffer(4096) as probe:
        refusal = asked.add_fixed_buffer(probe)  # on an engine of its own: it makes a table
        if refusal is not None and "this kernel" in refusal:
            pytest.skip(f"no sparse fixed-buffer tables: {refusal}")
        asked.remove_fixed_buffer(probe)


@pytest.fixture
def ring_engine(later_buffers: None) -> Iterator[IOEngine]:
    """An io_uring engine whose ring takes buffers after its first ones (Linux 5.19+)."""
    with IOEngine(queue_depth=4, compat="off", max_chunk=256 << 10) as engine:
        yield engine


@pytest.fixture
def small_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables with one spare slot, so that filling one takes two buffers."""
    monkeypatch.setattr(_fixed_buffers, "SPARE_SLOTS", 1)


def record_indexes(target: DirectFile) -> list[int | None]:
    """The fixed-buffer index of every chunk the ring builds on ``target`` from now on."""
    seen: list[int | None] = []
    build = target.io_op

    def io_op(is_write: bool, address: int, size: int, offset: int, index: int | None) -> Op:
        seen.append(index)
        return build(is_write, address, size, offset, index)

    target.io_op = io_op  # type: ignore[method-assign]
    return seen


async def round_trip(engine: IOEngine, target: DirectFile, buffer: AlignedBuffer) -> None:
    """Write random bytes from ``buffer`` and read them back into it: every byte right."""
    payload = os.urandom(SIZE)
    buffer.view[:SIZE] = payload
    await engine.pwrite(target, buffer, SIZE, 0)
    buffer.view[:SIZE] = bytes(SIZE)
    await engine.pread(target, buffer, SIZE, 0)
    assert hashlib.sha256(buffer.view[:SIZE]).digest() == hashlib.sha256(payload).digest()


async def test_a_buffer_added_later_moves_as_a_fixed_buffer(
    ring_engine: IOEngine, direct_file: DirectFile
) -> None:
    with AlignedBuffer(SIZE) as first, AlignedBuffer(SIZE) as later:
        ring_engine.register_buffers([first])
        assert ring_engine.add_fixed_buffer(later) is None
        assert ring_engine.is_registered(later)
        indexes = record_indexes(direct_file)
        # a wrong slot in the kernel's table would fail these reads (EFAULT) or land elsewhere
        await round_trip(ring_engine, direct_file, later)
        await round_trip(ring_engine, direct_file, first)
        half = len(indexes) // 2  # commands built per buffer: per chunk, or per request (pump)
        later_chunks, first_chunks = indexes[:half], indexes[half:]
        assert len(set(later_chunks)) == 1
        assert later_chunks[0] is not None
        assert len(set(first_chunks)) == 1
        assert first_chunks[0] is not None
        assert later_chunks[0] != first_chunks[0]
        ring_engine.remove_fixed_buffer(later)


async def test_an_engine_with_no_first_buffers_still_takes_one(
    ring_engine: IOEngine, direct_file: DirectFile
) -> None:
    with AlignedBuffer(SIZE) as buffer, AlignedBuffer(SIZE) as first:
        assert ring_engine.add_fixed_buffer(buffer) is None
        ring_engine.register_buffers([first])  # the first ones, later: into the same table
        indexes = record_indexes(direct_file)
        await round_trip(ring_engine, direct_file, buffer)
        await round_trip(ring_engine, direct_file, first)
        assert None not in indexes
        assert len(set(indexes)) == 2
        ring_engine.remove_fixed_buffer(buffer)


@pytest.mark.usefixtures("small_table")
async def test_a_removed_buffer_gives_its_slot_back(
    ring_engine: IOEngine, direct_file: DirectFile
) -> None:
    with (
        AlignedBuffer(SIZE) as first,
        AlignedBuffer(SIZE) as second,
        AlignedBuffer(SIZE) as third,
    ):
        ring_engine.register_buffers([first])
        assert ring_engine.add_fixed_buffer(second) is None
        refusal = ring_engine.add_fixed_buffer(third)
        assert refusal is not None
        assert "taken" in refusal
        assert not ring_engine.is_registered(third)
        indexes = record_indexes(direct_file)
        await round_trip(ring_engine, direct_file, third)  # unregistered: pinned per chunk
        assert set(indexes) == {None}
        ring_engine.remove_fixed_buffer(second)
        assert not ring_engine.is_registered(second)
        assert ring_engine.add_fixed_buffer(third) is None
        indexes.clear()
        await round_trip(ring_engine, direct_file, third)
        await round_trip(ring_engine, direct_file, second)  # after removal: a plain read
        half = len(indexes) // 2  # commands built per buffer: per chunk, or per request (pump)
        assert None not in indexes[:half]
        assert set(indexes[half:]) == {None}
        ring_engine.remove_fixed_buffer(third)
        ring_engine.remove_fixed_buffer(third)  # twice: nothing the second time


@pytest.mark.usefixtures("small_table")
async def test_a_buffer_collected_unremoved_frees_its_slot(
    ring_engine: IOEngine, direct_file: DirectFile
) -> None:
    with AlignedBuffer(SIZE) as first:
        ring_engine.register_buffers([first])
        dropped = AlignedBuffer(SIZE)
        assert ring_engine.add_fixed_buffer(dropped) is None
        dropped.close()
        del dropped
        gc.collect()
        # the slot is cleared on the ring thread before this add runs there (inbox order)
        with AlignedBuffer(SIZE) as taker:
            assert ring_engine.add_fixed_buffer(taker) is None
            await round_trip(ring_engine, direct_file, taker)
            ring_engine.remove_fixed_buffer(taker)


def test_the_thread_pool_engine_says_why_a_buffer_is_not_fixed() -> None:
    with IOEngine(queue_depth=4, compat="on") as engine, AlignedBuffer(SIZE) as buffer:
        refusal = engine.add_fixed_buffer(buffer)
        assert refusal is not None
        assert "thread-pool" in refusal
        assert not engine.is_registered(buffer)
        engine.remove_fixed_buffer(buffer)  # nothing registered: nothing to do


def test_a_passthrough_ring_says_why_a_buffer_is_not_fixed() -> None:
    with (
        IOEngine(queue_depth=4, compat="off", passthrough=True) as engine,
        AlignedBuffer(SIZE) as buffer,
    ):
        refusal = engine.add_fixed_buffer(buffer)
        assert refusal is not None
        assert "passthrough" in refusal
        assert not engine.is_registered(buffer)


@pytest.mark.usefixtures("later_buffers")
def test_a_closed_engine_says_why_and_forgets_its_table() -> None:
    engine = IOEngine(queue_depth=4, compat="off")
    with AlignedBuffer(SIZE) as kept, AlignedBuffer(SIZE) as late:
        assert engine.add_fixed_buffer(kept) is None
        engine.close()
        assert not engine.is_registered(kept)
        refusal = engine.add_fixed_buffer(late)
        assert refusal is not None
        assert "closed" in refusal
        engine.remove_fixed_buffer(kept)  # the table went with the ring: nothing to do


@pytest.mark.usefixtures("later_buffers")
def test_a_ring_whose_thread_is_gone_refuses_rather_than_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A daemon ring thread ended at interpreter exit would never answer: no wait for it."""
    engine = IOEngine(queue_depth=4, compat="off")
    ring = engine._backend
    alive = ring._thread  # type: ignore[attr-defined]
    gone = threading.Thread(target=lambda: None)
    gone.start()
    gone.join()
    monkeypatch.setattr(ring, "_thread", gone)
    with AlignedBuffer(SIZE) as buffer:
        refusal = engine.add_fixed_buffer(buffer)
        assert refusal is not None
        assert "ring thread ended" in refusal
        engine.remove_fixed_buffer(buffer)
    monkeypatch.setattr(ring, "_thread", alive)
    engine.close()


def test_under_a_finite_memlock_limit_later_buffers_stay_unregistered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without CAP_IPC_LOCK every pinned page counts against RLIMIT_MEMLOCK, and the next store's
    copy threads need that room to start: only the first buffers are registered there."""
    monkeypatch.setattr(_fixed_buffers, "memlock_note", lambda: "counts against RLIMIT_MEMLOCK")
    with (
        IOEngine(queue_depth=4, compat="off") as engine,
        AlignedBuffer(SIZE) as first,
        AlignedBuffer(SIZE) as later,
    ):
        engine.register_buffers([first])
        assert engine.is_registered(first)
        assert engine.add_fixed_buffer(later) == "counts against RLIMIT_MEMLOCK"
        assert not engine.is_registered(later)


@pytest.mark.parametrize(
    ("cap_eff", "granted"),
    [("000001fffeffffff", True), ("0000000000000000", False), ("0000000000004000", True)],
)
def test_cap_ipc_lock_is_read_from_the_effective_set(cap_eff: str, granted: bool) -> None:
    status = f"Name:\tpython\nCapInh:\t0000000000004000\nCapEff:\t{cap_eff}\n"
    assert _fixed_buffers.ipc_lock_in(status) is granted
    assert not _fixed_buffers.ipc_lock_in("Name:\tpython\n")
