"""The LBA map ``M: KPU -> (lba_start, n_blocks)``: the binder's book of direct KPU extents.

Three invariants (DESIGN §2), all established by :meth:`LbaMap.bind` and checked there:

- aligned: every extent is a whole number of logical blocks (the tensor image is padded by
  :class:`~.layout.TensorLayout` before it gets here; an unaligned size is refused);
- disjoint: no two extents share a block;
- contiguous: ``lba_start(n + 1) = lba_start(n) + n_blocks(n)``; only the first start is chosen
  (by the user, as ``first_lba``), so all of Group 2 is one sequential run on the device and the
  controller sees one stream, not the interleaved fragments blk-mq makes of page-cache misses.

Every extent lies inside the *region* the user declared for dualblade (``first_lba`` and
``extent_size`` of the target); a map that would leave it is refused with
:class:`~.errors.ExtentOverflowError` instead of writing over whoever owns the blocks behind it.

For file and block targets the same map is used with the LBA read as ``byte offset / lba_size``:
:attr:`KpuExtent.byte_offset` is the ``pread``/``pwrite`` offset.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from dualblade.pipeline.errors import ExtentOverflowError, PlanError
from dualblade.pipeline.kpu import KpuId
from dualblade.pipeline.sizes import BlockCount, ByteCount, Lba, format_size


@dataclass(frozen=True)
class Region:
    """The blocks a target lends dualblade: ``[first_lba, first_lba + n_blocks)``."""

    first_lba: Lba
    n_blocks: BlockCount

    def __post_init__(self) -> None:
        if self.first_lba < 0 or self.n_blocks < 0:
            raise PlanError(f"a region needs a non-negative start and size (got {self})")

    @property
    def end(self) -> Lba:
        """The first LBA after the region."""
        return Lba(self.first_lba + self.n_blocks)


@dataclass(frozen=True)
class KpuExtent:
    """Where one KPU lives: ``n_blocks`` blocks from ``lba_start``."""

    kpu: KpuId
    lba_start: Lba
    n_blocks: BlockCount
    lba_size: ByteCount

    @property
    def end(self) -> Lba:
        """The first LBA after the extent."""
        return Lba(self.lba_start + self.n_blocks)

    @property
    def byte_offset(self) -> ByteCount:
        """The extent's start as a byte offset: the file offset on file and block targets."""
        return ByteCount(self.lba_start * self.lba_size)

    @property
    def nbytes(self) -> ByteCount:
        """The extent's size in bytes."""
        return ByteCount(self.n_blocks * self.lba_size)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"kpu": "L3.K", "lba_start": ..., "n_blocks": ..., ...}``."""
        return {
            "kpu": str(self.kpu),
            "lba_start": self.lba_start,
            "n_blocks": self.n_blocks,
            "byte_offset": self.byte_offset,
            "nbytes": self.nbytes,
        }


@dataclass(frozen=True)
class LbaMap:
    """Contiguous, disjoint, aligned extents of KPUs inside a region; immutable once bound."""

    region: Region
    lba_size: ByteCount
    extents: tuple[KpuExtent, ...]
    _index: dict[KpuId, KpuExtent] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {extent.kpu: extent for extent in self.extents})

    @classmethod
    def bind(
        cls,
        tensors: Sequence[tuple[KpuId, int]],
        region: Region,
        lba_size: int,
        start: Lba | None = None,
    ) -> LbaMap:
        """Lay ``tensors`` (KPU, bytes) out back to back from ``start`` (default: the region's).

        A second map for another request context can start at the first map's :attr:`end`.

        Raises:
            PlanError: a size is not a positive multiple of ``lba_size``, a KPU repeats, or
                ``start`` lies outside the region.
            ExtentOverflowError: the tensors do not fit between ``start`` and the region's end.
        """
        first = region.first_lba if start is None else start
        if not region.first_lba <= first <= region.end:
            raise PlanError(f"start LBA {first} lies outside the region {region}")
        seen: set[KpuId] = set()
        extents: list[KpuExtent] = []
        cursor = first
        for kpu, nbytes in tensors:
            if nbytes <= 0 or nbytes % lba_size:
                raise PlanError(
                    f"{kpu}: {nbytes} bytes is not a positive multiple of the LBA size "
                    f"{lba_size}; pad the tensor's rows first (TensorLayout)"
                )
            if kpu in seen:
                raise PlanError(f"{kpu} is bound twice")
            seen.add(kpu)
            n_blocks = BlockCount(nbytes // lba_size)
            extents.append(KpuExtent(kpu, cursor, n_blocks, ByteCount(lba_size)))
            cursor = Lba(cursor + n_blocks)
        if cursor > region.end:
            needed = cursor - first
            room = region.end - first
            raise ExtentOverflowError(
                f"the direct KPUs need {needed} blocks ({format_size(needed * lba_size)}) from "
                f"LBA {first}, but the declared extent ends at LBA {region.end}, leaving "
                f"{room} blocks ({format_size(room * lba_size)}); enlarge extent_size or "
                "place fewer layers on the direct path"
            )
        return cls(region, ByteCount(lba_size), tuple(extents))

    def lookup(self, kpu: KpuId) -> KpuExtent:
        """The extent of a KPU (Algorithm 2's first step).

        Raises:
            PlanError: the KPU is not on the direct path.
        """
        try:
            return self._index[kpu]
        except KeyError:
            raise PlanError(f"{kpu} has no direct extent (it is on the page-cache path)") from None

    @property
    def start(self) -> Lba:
        """The first bound LBA (the region's start for an empty map)."""
        return self.extents[0].lba_start if self.extents else self.region.first_lba

    @property
    def end(self) -> Lba:
        """The first LBA after the last extent: where a next map may start."""
        return self.extents[-1].end if self.extents else self.region.first_lba

    @property
    def used_blocks(self) -> BlockCount:
        """Blocks bound by all extents together."""
        return BlockCount(sum(extent.n_blocks for extent in self.extents))

    def __contains__(self, kpu: object) -> bool:
        return kpu in self._index

    def __iter__(self) -> Iterator[KpuExtent]:
        return iter(self.extents)

    def __len__(self) -> int:
        return len(self.extents)
