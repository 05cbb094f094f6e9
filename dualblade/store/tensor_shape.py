"""What a tensor handed to a context must look like, checked at the door with a clear message.

A K or V tensor is ``[rows, batch, kv_heads * head_dim]`` (``[rows, batch, kv_heads, head_dim]``
is accepted too) of the context's dtype; a decode row may drop its leading 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dualblade.store.errors import KVShapeError


def on_device(tensor: torch.Tensor, device: torch.device) -> bool:
    """``cuda`` (no index) means the current CUDA device: ``cuda:0`` tensors match it."""
    if tensor.device.type != device.type:
        return False
    return device.index is None or tensor.device.index == device.index


@dataclass(frozen=True)
class KVTensorShape:
    """The shape every K and V tensor of one context has."""

    batch: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def width(self) -> int:
        return self.kv_heads * self.head_dim

    def normalize(self, name: str, tensor: torch.Tensor, rows: int | None) -> torch.Tensor:
        """``tensor`` as ``[rows, batch, width]``; ``rows`` (when given) must match.

        Raises:
            KVShapeError: not a tensor, or the wrong dtype, shape or number of rows.
        """
        if not isinstance(tensor, torch.Tensor):
            raise KVShapeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != self.dtype:
            raise KVShapeError(f"{name} has dtype {tensor.dtype}; this store holds {self.dtype}")
        shape = tuple(tensor.shape)
        if len(shape) == 4 and shape[2:] == (self.kv_heads, self.head_dim):
            tensor = tensor.reshape(shape[0], shape[1], self.width)
        elif len(shape) == 2 and rows == 1:
            tensor = tensor.reshape(1, *shape)
        shape = tuple(tensor.shape)
        expected = (
            f"[rows, {self.batch}, {self.width}] "
            f"(or [rows, {self.batch}, {self.kv_heads}, {self.head_dim}])"
        )
        if len(shape) != 3 or shape[1] != self.batch or shape[2] != self.width:
            raise KVShapeError(f"{name} has shape {list(shape)}; expected {expected}")
        if rows is not None and shape[0] != rows:
            raise KVShapeError(f"{name} has {shape[0]} rows; expected {rows}")
        return tensor

    def out_views(
        self, out: object, rows: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``rows`` rows of a caller's ``(k, v)`` read buffers.

        Raises:
            KVShapeError: ``out`` is not a pair of contiguous tensors of this shape and dtype,
                with at least ``rows`` rows, on ``device``.
        """
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise KVShapeError("out must be a (k, v) pair of tensors")
        views = []
        for name, tensor in zip("kv", out, strict=True):
            if not isinstance(tensor, torch.Tensor):
                raise KVShapeError(f"out {name} must be a tensor, got {type(tensor).__name__}")
            if (
                tensor.dim() != 3
                or tensor.shape[0] < rows
                or tuple(tensor.shape[1:]) != (self.batch, self.width)
                or tensor.dtype != self.dtype
                or not on_device(tensor, device)
                or not tensor.is_contiguous()
            ):
                raise KVShapeError(
                    f"out {name} is {tensor.dtype} {list(tensor.shape)} on {tensor.device}; "
                    f"this read needs a contiguous {self.dtype} [>= {rows}, {self.batch}, "
                    f"{self.width}] on {device}"
                )
            views.append(tensor[:rows])
        return views[0], views[1]


def requested_rows(rows: object, written: int, layer: int) -> tuple[int, int]:
    """The ``(start, stop)`` a read asks for (None: every written row), checked.

    Raises:
        KVShapeError: not a pair of ints, or rows that were never written.
    """
    if rows is None:
        start, stop = 0, written
    elif (
        isinstance(rows, tuple | list)
        and len(rows) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in rows)
    ):
        start, stop = rows
    else:
        raise KVShapeError(f"rows must be a (start, stop) pair of ints, got {rows!r}")
    if not 0 <= start < stop <= written:
        raise KVShapeError(
            f"rows [{start}, {stop}) of layer {layer} were never written "
            f"(it holds rows [0, {written}))"
        )
    return start, stop
