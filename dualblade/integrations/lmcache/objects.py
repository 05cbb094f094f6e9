"""An LMCache memory object as one store layer's K and V, and back.

A memory object is a contiguous CPU tensor of any dtype; the store holds float16 rows
(:class:`~.params.ObjectGeometry`). Its bytes are seen as ``2 * rows`` rows: the first half is
the layer's K, the second its V, each ``[rows, 1, row_elements]``. Where the object fills those
rows exactly (1 MiB objects do) the K and V tensors are views of LMCache's own memory, so
storage reads into it and writes from it itself (the store's straight transfers, where the
memory is aligned as the target needs; its copy threads otherwise), with no copy of ours. An
object that does not (a size that is not a multiple of two rows, or a start that is not 2-byte
aligned) goes through a zero-padded staging tensor of its padded size, made for that transfer
only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dualblade.integrations.lmcache.params import ObjectGeometry


class ObjectShapeError(ValueError):
    """A memory object the adapter cannot hold: no tensor, not on the CPU, not contiguous, or
    larger than ``object_size``."""


def object_bytes(obj: Any) -> torch.Tensor:
    """The memory object's bytes as a flat uint8 tensor that aliases them.

    Raises:
        ObjectShapeError: the object has no valid tensor, or it is not contiguous CPU memory.
    """
    tensor: torch.Tensor | None = obj.tensor
    if tensor is None:
        raise ObjectShapeError("the memory object has no tensor (it was invalidated)")
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ObjectShapeError(
            f"the memory object is a {'contiguous' if tensor.is_contiguous() else 'strided'} "
            f"tensor on {tensor.device}; the adapter moves contiguous CPU memory"
        )
    flat = tensor.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    size = int(obj.get_size())
    if size > flat.numel():
        raise ObjectShapeError(f"the memory object says {size} bytes but holds {flat.numel()}")
    return flat[:size]


@dataclass(frozen=True)
class ObjectRegion:
    """An object's bytes as storage can take them: the tensor that holds them (its first
    ``nbytes``), and how many rows of K and of V they are."""

    owner: torch.Tensor
    nbytes: int
    rows: int


def exact_region(obj: Any, geometry: ObjectGeometry) -> ObjectRegion | None:
    """The object's bytes, found without building a tensor over them, where they are exactly
    its K and V rows (1 MiB objects are); None where not (a size that is not whole rows, an
    odd start, an object larger than ``object_size``, an invalidated object, or one whose
    ``raw_data`` is no contiguous CPU tensor) — :func:`object_bytes` and :func:`kv_image` then
    say what is wrong or stage it.

    Why beside :func:`object_bytes`: that goes through LMCache's ``tensor`` property and a
    reshape, views and slices, about a dozen torch calls per object on the adapter's
    event-loop thread, which is what sets the rate of loads. Reading ``raw_data`` and
    ``get_size()`` instead raised loads from 3.3 to 4.1 GB/s in a harness driving the adapter
    (1 MiB objects, half of them on each path).
    """
    raw = getattr(obj, "raw_data", None)
    if not isinstance(raw, torch.Tensor) or not obj.is_valid():
        return None
    nbytes = int(obj.get_size())
    rows = geometry.rows_for(nbytes)
    if (
        nbytes != 2 * rows * geometry.row_bytes
        or rows > geometry.max_rows
        or raw.device.type != "cpu"
        or not raw.is_contiguous()
        or raw.numel() * raw.element_size() < nbytes
        or raw.data_ptr() % 2
    ):
        return None
    return ObjectRegion(raw, nbytes, rows)


@dataclass(frozen=True)
class KVImage:
    """An object's K and V rows, and the staging tensor behind them when they are not views of
    the object (``staged``); ``rows`` rows each."""

    k: torch.Tensor
    v: torch.Tensor
    rows: int
    staged: torch.Tensor | None


def kv_image(flat: torch.Tensor, geometry: ObjectGeometry, *, fill: bool) -> KVImage:
    """K and V row tensors over ``flat`` (an object's bytes; see the module docstring).

    ``fill``: for a store, copy the object into the staging tensor when one is needed; a load
    leaves it to :func:`unstage` after the read.

    Raises:
        ObjectShapeError: the object is larger than the geometry's ``object_size``.
    """
    nbytes = flat.numel()
    rows = geometry.rows_for(nbytes)
    if rows > geometry.max_rows:
        raise ObjectShapeError(
            f"a {nbytes}-byte object is larger than this adapter's object_size "
            f"({geometry.max_object_bytes} bytes): raise adapter_params.object_size"
        )
    padded = 2 * rows * geometry.row_bytes
    staged: torch.Tensor | None = None
    if nbytes == padded and flat.data_ptr() % 2 == 0:
        base = flat
    else:
        staged = torch.zeros(padded, dtype=torch.uint8)
        if fill:
            staged[:nbytes].copy_(flat)
        base = staged
    rows_view = base.view(torch.float16).view(2 * rows, 1, geometry.row_elements)
    return KVImage(rows_view[:rows], rows_view[rows:], rows, staged)


def unstage(image: KVImage, flat: torch.Tensor) -> None:
    """After a load: copy the staged bytes (if any) into the object's own."""
    if image.staged is not None:
        flat.copy_(image.staged[: flat.numel()])
