"""A window of an aligned buffer: ``nbytes`` from ``offset``, checked to lie inside it.

Memory one part lends another by position rather than by buffer: a store's copy threads' KPU
images (each a window of its thread's pinned buffer, the room for rows after them no image),
which a reference that moves bytes as the pipeline does borrows, and any memory a caller lends
such a reference whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualblade.io_engine.buffers import AlignedBuffer


@dataclass(frozen=True)
class BufferWindow:
    """``nbytes`` of ``buffer`` from ``offset``.

    Raises:
        ValueError: the window is empty or does not lie inside the buffer.
    """

    buffer: AlignedBuffer
    offset: int
    nbytes: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.nbytes <= 0 or self.offset + self.nbytes > self.buffer.size:
            raise ValueError(
                f"a window of {self.nbytes} bytes at {self.offset} does not lie inside a "
                f"{self.buffer.size}-byte buffer"
            )

    @classmethod
    def whole(cls, buffer: AlignedBuffer) -> BufferWindow:
        """All of ``buffer``."""
        return cls(buffer, 0, buffer.size)
