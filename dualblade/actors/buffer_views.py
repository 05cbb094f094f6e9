"""A copy thread's pinned buffer seen as tensors of rows, each view made once.

A decoder asks for the same few views (one per layer shape and piece) again and again; making one
is five tensor operations, 70 us of the event loop per piece on the H200 machine.
"""

from __future__ import annotations

import torch

from dualblade.actors.copy_messages import RowView
from dualblade.io_engine import AlignedBuffer

#: Views kept (a few per layer shape; the cache empties when full).
VIEW_CACHE_SIZE = 256


class BufferViews:
    """Row views of ``buffer``; :meth:`clear` before the buffer is closed (they alias it)."""

    def __init__(self, buffer: AlignedBuffer) -> None:
        self._buffer = buffer
        self._bytes: torch.Tensor | None = None  # the whole buffer, sliced per view
        self._views: dict[RowView, torch.Tensor] = {}

    def __call__(self, view: RowView) -> torch.Tensor:
        tensor = self._views.get(view)
        if tensor is None:
            if len(self._views) >= VIEW_CACHE_SIZE:
                self._views.clear()
            if self._bytes is None:
                self._bytes = self._buffer.tensor()
            tensor = self._views[view] = view.tensor(self._bytes)
        return tensor

    def clear(self) -> None:
        self._views.clear()
        self._bytes = None
