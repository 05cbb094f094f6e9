"""pipebench's pipeline side: every layer once, one read per read buffer at a time."""

from __future__ import annotations

from typing import Any, cast

import anyio
import pytest

from dualblade.bench.pipebench import pipeline_pass
from dualblade.store import KVContext, ReadBuffers

pytestmark = pytest.mark.anyio


class _RecordingContext:
    """Stands in for a context: records which layer each read took and into which buffers."""

    def __init__(self) -> None:
        self.layers: list[int] = []
        self.busy: set[int] = set()  # ids of the buffers a read is landing in now
        self.peak = 0

    async def read(self, layer: int, *, out: Any) -> None:
        assert id(out) not in self.busy, "two reads landed in one buffer at once"
        self.busy.add(id(out))
        self.peak = max(self.peak, len(self.busy))
        self.layers.append(layer)
        await anyio.sleep(0.001 * (1 + layer % 3))  # reads of different lengths
        self.busy.discard(id(out))


@pytest.mark.parametrize("buffers", [1, 2, 3])
async def test_every_layer_is_read_once_with_one_read_per_buffer(buffers: int) -> None:
    ctx = _RecordingContext()
    pool = cast(list[ReadBuffers], [object() for _ in range(buffers)])
    await pipeline_pass(cast(KVContext, ctx), 12, pool)
    assert sorted(ctx.layers) == list(range(12))
    assert ctx.peak == buffers  # every buffer kept busy, never more reads than buffers
    assert ctx.layers[:buffers] == list(range(buffers))  # started in layer order
