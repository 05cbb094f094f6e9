"""The errors a store raises to the caller of a context's operations."""

from __future__ import annotations

from dualblade.errors import DualbladeError


class KVShapeError(DualbladeError, ValueError):
    """A tensor handed to the store has the wrong shape, dtype, layer or rows."""

    exit_code = 2


class ContextClosedError(DualbladeError):
    """The context was used after it closed."""


class LayerLostError(DualbladeError):
    """A write to the layer failed or was cancelled part-way: its stored rows are a mix of old
    and new bytes, so reads and appends are refused until the layer is written again."""
