"""Several observers of the ring's completed chunks, as the one the ring calls.

The ring calls one observer per chunk, on its own thread, with nothing else between the
completion and the next one. A traced store's I/O track and the bench's request log each want
every chunk, so :meth:`IOEngine.observe_chunks` chains them here rather than giving the ring a
list to walk for the common case of one or none.
"""

from __future__ import annotations

from typing import Any

from dualblade.io_engine.ring import ChunkObserver


def chained(first: ChunkObserver | None, second: ChunkObserver) -> ChunkObserver:
    """One observer that calls ``first`` (if any), then ``second``, with the same chunk."""
    if first is None:
        return second

    def both(*chunk: Any) -> None:  # the chunk as ChunkObserver describes it
        first(*chunk)
        second(*chunk)

    return both
