"""A request's decode steps over its layers: every step sees every row written before it, a
buffer is never read into while a layer in it is unused, and the next step's first layers are
read in a step's tail only after that step's append of them."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dualblade.models import LayerWalk
from dualblade.models.kv import MemoryKVContext
from dualblade.pipeline import ReadAhead

pytestmark = pytest.mark.anyio

BATCH, WIDTH = 2, 8


def _row(layer: int, row: int) -> torch.Tensor:
    """The K row ``row`` of ``layer`` (V is its negation): every value names both."""
    return torch.full((1, BATCH, WIDTH), float(layer * 1000 + row), dtype=torch.float16)


class _BufferedCache(MemoryKVContext):
    """An in-memory cache whose reads take a buffer token and hold it until the layer is used;
    a read into a token still held, or of a layer while its append is in flight, fails."""

    def __init__(self, layers: int, slow: list[int], max_len: int) -> None:
        super().__init__(layers, BATCH, max_len, WIDTH, torch.float16, "cpu")
        self.slow = slow
        self.held: dict[int, int] = {}  # buffer -> layer read into it, until used
        self.appending: set[int] = set()
        self.log: list[str] = []

    def read_order(self, buffers: int) -> ReadAhead:
        return ReadAhead(len(self._k), buffers, self.slow)

    async def read(self, layer: int, *, out: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        assert out not in self.held, f"buffer {out} read into while layer {self.held[out]} holds it"
        assert layer not in self.appending, f"layer {layer} read while its append is in flight"
        self.held[out] = layer
        self.log.append(f"read {layer}")
        await anyio.sleep(0.001 * (layer % 3))
        return await super().read(layer)

    async def append(self, layer: int, k_row: torch.Tensor, v_row: torch.Tensor) -> int:
        self.appending.add(layer)
        self.log.append(f"append {layer}")
        await anyio.sleep(0.002 * ((layer + 1) % 2))
        try:
            return await super().append(layer, k_row, v_row)
        finally:
            self.appending.discard(layer)

    def used(self, layer: int) -> None:
        (buffer,) = [b for b, held in self.held.items() if held == layer]
        del self.held[buffer]


async def _prefill(cache: _BufferedCache, walk: LayerWalk, layers: int, prompt: int) -> None:
    written = [anyio.Event() for _ in range(layers)]

    async def write(layer: int) -> None:
        k = torch.cat([_row(layer, r) for r in range(prompt)])
        await cache.write(layer, k, -k)
        written[layer].set()

    async with anyio.create_task_group() as tg:
        for layer in range(layers):
            tg.start_soon(write, layer)
        walk.read_first(tg, written)


async def _decode(
    cache: _BufferedCache, walk: LayerWalk, layers: int, prompt: int, steps: int
) -> None:
    for step in range(steps):
        rows = prompt + step  # written before this step

        async def use(layer: int, k: torch.Tensor, v: torch.Tensor, rows: int = rows) -> Any:
            want = torch.cat([_row(layer, r) for r in range(rows)])
            assert torch.equal(k, want), f"layer {layer}'s K is stale"
            assert torch.equal(v, -want), f"layer {layer}'s V is stale"
            cache.used(layer)
            await anyio.sleep(0)
            return _row(layer, rows), -_row(layer, rows)

        more = step + 1 < steps
        await walk.step(use, more=more)
        carried = walk.carried_layers
        assert len(carried) < len(walk.buffers)  # the next step starts with one free
        assert (len(carried) > 0) == (more and walk.carry and len(walk.buffers) > 1)


@settings(
    deadline=None, max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    layers=st.integers(1, 7),
    buffers=st.integers(1, 5),
    steps=st.integers(1, 4),
    data=st.data(),
)
async def test_every_step_reads_every_row_written_before_it(
    layers: int, buffers: int, steps: int, data: st.DataObject
) -> None:
    slow = sorted(data.draw(st.sets(st.integers(0, layers - 1))))
    carry = data.draw(st.booleans())
    cache = _BufferedCache(layers, slow, 3 + steps)
    walk = LayerWalk(cache, list(range(buffers)), carry=carry)
    await _prefill(cache, walk, layers, 3)
    await _decode(cache, walk, layers, 3, steps)
    assert not cache.held


async def _step(cache: _BufferedCache, walk: LayerWalk, rows: int, *, more: bool) -> list[str]:
    """One step of ``_decode``'s; returns what the cache logged during it."""
    cache.log.clear()

    async def use(layer: int, k: torch.Tensor, v: torch.Tensor) -> Any:
        assert torch.equal(k, torch.cat([_row(layer, r) for r in range(rows)]))
        cache.used(layer)
        await anyio.sleep(0)
        return _row(layer, rows), -_row(layer, rows)

    await walk.step(use, more=more)
    return list(cache.log)


async def test_a_steps_tail_reads_the_next_steps_first_layers_after_their_appends() -> None:
    cache = _BufferedCache(6, [], 8)
    walk = LayerWalk(cache, list(range(3)))
    await _prefill(cache, walk, 6, 2)
    assert sorted(cache.log) == ["read 0", "read 1"]  # every buffer but one
    log = await _step(cache, walk, 2, more=True)
    reads = [e for e in log if e.startswith("read")]
    assert reads[:4] == ["read 2", "read 3", "read 4", "read 5"]  # then each as its append lands:
    assert sorted(reads[4:]) == ["read 0", "read 1"]
    for layer in (0, 1):
        assert log.index(f"read {layer}") > log.index(f"append {layer}")
    assert walk.carried_layers == [0, 1]
    log = await _step(cache, walk, 3, more=False)
    assert [e for e in log if e.startswith("read")] == [f"read {i}" for i in (2, 3, 4, 5)]
    assert walk.carried_layers == []


async def test_the_next_steps_direct_layer_is_asked_for_before_this_steps_last_layers() -> None:
    # Layer 1 is slow (direct); the next step's first reads are 0 and 1. Once this step's own
    # slow layer is read, a freed buffer goes to the next step's layer 1 (once its append
    # lands), ahead of this step's last layers: the disk is not left idle until its end.
    cache = _BufferedCache(6, [1], 8)
    walk = LayerWalk(cache, list(range(3)))
    await _prefill(cache, walk, 6, 2)
    assert walk.carried_layers == [0, 1]
    log = await _step(cache, walk, 2, more=True)
    assert log.index("append 1") < log.index("read 1") < log.index("read 5") < log.index("read 0")
    assert sorted(e for e in log if e.startswith("read")) == [f"read {i}" for i in range(6)]
    assert walk.carried_layers == [0, 1]


async def test_without_a_carry_each_step_reads_only_its_own_layers() -> None:
    cache = _BufferedCache(4, [], 8)
    walk = LayerWalk(cache, list(range(2)), carry=False)
    await _prefill(cache, walk, 4, 2)
    assert cache.log == []
    await _decode(cache, walk, 4, 2, 2)
    reads = [e for e in cache.log if e.startswith("read")]
    assert sorted(reads) == sorted([f"read {i}" for i in range(4)] * 2)


async def test_a_failed_step_carries_nothing_into_the_next() -> None:
    cache = _BufferedCache(4, [], 8)
    walk = LayerWalk(cache, list(range(2)))
    await _prefill(cache, walk, 4, 2)

    async def broken(layer: int, k: torch.Tensor, v: torch.Tensor) -> Any:
        raise RuntimeError("compute failed")

    with pytest.raises(RuntimeError, match="compute failed"):
        await walk.step(broken, more=True)
    assert walk.carried_layers == []


async def test_misuse_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one read buffer"):
        LayerWalk(_BufferedCache(2, [], 4), [])
    cache = _BufferedCache(2, [], 4)
    walk = LayerWalk(cache, [0, 1])
    await _prefill(cache, walk, 2, 1)
    async with anyio.create_task_group() as tg:
        with pytest.raises(ValueError, match="read already"):
            walk.read_first(tg, [anyio.Event(), anyio.Event()])
    order = ReadAhead(3, 2)
    order.adopt(0, 1)
    with pytest.raises(ValueError, match="adopted twice"):
        order.adopt(1, 1)
    with pytest.raises(ValueError, match="outside"):
        order.adopt(3, 0)
    assert order.start() == [(1, 0)]
    with pytest.raises(ValueError, match="before the order starts"):
        order.adopt(2, 0)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # trio shuffles a turn's tasks
async def test_a_use_that_never_yields_still_lets_each_fetch_begin_before_the_next_use() -> None:
    # The engine's CUDA decode queues a layer's kernels without yielding: the walk's wait for
    # the next layer, landed or not, must be the turn in which the fetch that layer freed begins.
    layers, buffers = 6, 2
    cache = MemoryKVContext(layers, BATCH, 8, WIDTH, torch.float16, "cpu")
    for layer in range(layers):
        await cache.write(layer, _row(layer, 0), -_row(layer, 0))
    begun: list[int] = []
    instant_read = cache.read

    async def read(layer: int, *, out: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        begun.append(layer)
        return await instant_read(layer)

    cache.read = read  # type: ignore[method-assign]
    seen: list[list[int]] = []

    async def use(layer: int, k: torch.Tensor, v: torch.Tensor) -> Any:
        seen.append(list(begun))
        return _row(layer, 1), -_row(layer, 1)

    await LayerWalk(cache, [None] * buffers, carry=0).step(use, more=False)
    for layer in range(1, layers - buffers + 1):
        assert layer - 1 + buffers in seen[layer], f"layer {layer} used before its next fetch"
