"""A whole plan from a config: the budget, Algorithm 1's groups and the LBA map of Group 2.

:func:`make_plan` is pure: it takes the config and an already-derived budget. :func:`budget_for`
is the one step that looks at the machine (the memory limits), and only when neither the caller
nor the config states a limit or a budget. ``dualblade plan`` is these two calls and a printer.

Sizes the plan uses:

- a layer's page-cache footprint is its K and V payload, each rounded up to whole pages — what
  the page cache will hold for the layer's two files;
- ``M_pin``, one copy thread's pinned buffer, is one KPU's padded image rounded up to a page;
- a direct KPU's extent is its padded image (:class:`~.layout.TensorLayout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dualblade.pipeline.budget import (
    MemoryLimit,
    PageCacheBudget,
    derive_budget,
    explicit_limit,
    fixed_budget,
    limit_from_snapshot,
)
from dualblade.pipeline.config import PipelineConfig
from dualblade.pipeline.kpu import layer_kpus
from dualblade.pipeline.layer_order import page_cache_order
from dualblade.pipeline.layout import TensorLayout
from dualblade.pipeline.lba_map import LbaMap, Region
from dualblade.pipeline.memory import discover_memory
from dualblade.pipeline.placement import Placement, place_layers
from dualblade.pipeline.shapes import ModelShape
from dualblade.pipeline.sizes import PAGE_SIZE, BlockCount, Lba, round_up


@dataclass(frozen=True)
class Plan:
    """Everything decided before the first byte moves."""

    config: PipelineConfig
    shape: ModelShape
    layout: TensorLayout
    budget: PageCacheBudget
    placement: Placement
    lba_map: LbaMap

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, budget and groups first (they are what a reader looks for)."""
        workload = self.config.workload
        target = self.config.storage.direct
        return {
            "budget": self.budget.to_dict(),
            "groups": {
                "page_cache": list(self.placement.page_cache),
                "direct": list(self.placement.direct),
            },
            "placement": self.placement.to_dict(),
            "model": {
                "name": self.shape.name,
                "num_layers": self.shape.num_layers,
                "num_kv_heads": self.shape.num_kv_heads,
                "head_dim": self.shape.head_dim,
                "dtype": self.shape.dtype,
                "kpu_bytes": self.shape.kpu_bytes(workload.batch, workload.max_len),
                "total_kv_bytes": self.shape.total_kv_bytes(workload.batch, workload.max_len),
            },
            "workload": {**workload.model_dump(), "max_len": workload.max_len},
            "layout": {
                "rows": self.layout.rows,
                "row_bytes": self.layout.row_bytes,
                "row_stride": self.layout.row_stride,
                "padding_overhead": self.layout.padding_overhead,
                "lba_size": self.layout.lba_size,
            },
            "target": {
                "kind": target.kind,
                "path": str(target.path),
                "first_lba": self.lba_map.region.first_lba,
                "region_blocks": self.lba_map.region.n_blocks,
                "used_blocks": self.lba_map.used_blocks,
            },
            "extents": [extent.to_dict() for extent in self.lba_map],
        }


def tensor_layout(config: PipelineConfig) -> TensorLayout:
    """The padded row layout every K and V tensor of this config has on the direct target."""
    workload = config.workload
    return TensorLayout.for_shape(
        config.shape(), workload.batch, workload.max_len, config.storage.direct.lba_size
    )


def pin_bytes(config: PipelineConfig) -> int:
    """``M_pin``: one KPU's padded image, rounded up to a page (Co-DMA's alignment)."""
    return round_up(tensor_layout(config).image_bytes, PAGE_SIZE)


def pin_images_for(device_type: str) -> int:
    """The most KPU images a copy thread's pinned buffer has a use for on a device of this type.

    On CUDA a KPU leaves the buffer by a GPU copy that is answered a few hundred microseconds
    after the read: with one image the next read waits that long, with two it goes on in the
    other image (the H200 machine's pipebench: see docs/pipeline-profile.md). On the host path
    direct loads land in the caller's read buffers and the pinned buffer only stages stores and
    unaligned loads: a second image would be memory taken from the page cache for nothing.
    :func:`pin_images_in_plan` says whether the second image is worth its memory.
    """
    return 2 if device_type == "cuda" else 1


def pin_images_in_plan(
    config: PipelineConfig,
    device_type: str,
    memory_limit: int | None = None,
    *,
    row_room: int = 0,
    reserved: int = 0,
    root: Path = Path("/"),
) -> int:
    """KPU images per copy thread's buffer for a store of ``config``: :func:`pin_images_for`,
    less one where the second image's memory would keep a layer of the config's context out of
    the page cache.

    Why: the second image only hides the wait for a GPU copy (milliseconds per KPU read). Where
    the budget leaves layers on the direct path, the decode is bound by the disk's read of those
    layers (docs/bench.md: 1.03 of its floor at 4 GiB on the GPU machine), and a copy thread's
    second image (one KPU, 136 MB for OPT-6.7B at batch 32) would hold its share of a layer in the
    page cache instead. So one image wherever one image places more layers in the page cache;
    two where the whole context fits either way, or where no budget moves a layer (the direct
    policy). A CUDA copy thread runs one transfer per image, and a layer's K and V are leased
    together: a store of one copy thread keeps two images.

    The choice is made once, when a store starts, for the config's own workload shape (the limit
    is read once for both counts); a later budget change re-plans layers, not images.
    ``row_room``: each buffer's bytes beyond its images; ``reserved``: memory claimed but not
    touched yet (see :func:`budget_for`).

    Raises:
        MemoryDiscoveryError: discovery was needed and ``/proc/meminfo`` is unreadable.
    """
    most = pin_images_for(device_type)
    if most == 1 or config.copy_threads < 2:
        return most
    limit = _limit_for(config, memory_limit, root)
    layer_bytes = layer_page_cache_bytes(config)
    order = page_cache_order(len(layer_bytes), config.page_cache_layers)

    def page_cache_layers(images: int) -> int:
        budget = _budget_under(
            config, limit, pinned_in_use=0, pin_images=images, reserved=reserved, row_room=row_room
        )
        placement = place_layers(
            config.policy, layer_bytes, budget.page_cache_bytes, budget.knob_x_bytes, order
        )
        return len(placement.page_cache)

    return 1 if page_cache_layers(1) > page_cache_layers(most) else most


def layer_page_cache_bytes(config: PipelineConfig) -> list[int]:
    """Each layer's page-cache footprint: K and V payloads, each rounded up to pages."""
    shape = config.shape()
    kpu = shape.kpu_bytes(config.workload.batch, config.workload.max_len)
    return [2 * round_up(kpu, PAGE_SIZE)] * shape.num_layers


def budget_for(
    config: PipelineConfig,
    memory_limit: int | None = None,
    root: Path = Path("/"),
    *,
    pinned_in_use: int = 0,
    pin_images: int = 1,
    reserved: int = 0,
    row_room: int = 0,
) -> PageCacheBudget:
    """The page-cache budget, from the first of: ``memory_limit`` (e.g. ``--memory-limit``),
    ``memory.page_cache_budget``, ``memory.limit``, or the limits discovered under ``root``.

    ``pinned_in_use``: the pinned buffers' bytes already allocated by the caller (a running
    store). Discovered limits count them in use already, so they are not reserved again; a
    stated limit counts nothing in use, so the whole reservation is subtracted from it.
    ``pin_images``: KPU images per copy thread's buffer (see :func:`pin_images_for`);
    ``row_room``: the bytes each buffer holds beyond them (a CUDA copy thread's room for rows).
    ``reserved``: memory claimed but not touched yet, kept out of a derived budget (a stated
    ``page_cache_budget`` is taken as it is).

    Raises:
        MemoryDiscoveryError: discovery was needed and ``/proc/meminfo`` is unreadable.
    """
    limit = _limit_for(config, memory_limit, root)
    return _budget_under(
        config,
        limit,
        pinned_in_use=0 if _stated(config, memory_limit) else pinned_in_use,
        pin_images=pin_images,
        reserved=reserved,
        row_room=row_room,
    )


def _stated(config: PipelineConfig, memory_limit: int | None) -> bool:
    """Whether the limit is given (by the caller or the config) rather than discovered."""
    return memory_limit is not None or config.memory.limit is not None


def _limit_for(config: PipelineConfig, memory_limit: int | None, root: Path) -> MemoryLimit | None:
    """The limit a budget derives from, read once; None where the config states the budget."""
    if memory_limit is None and config.memory.page_cache_budget is not None:
        return None
    stated = memory_limit if memory_limit is not None else config.memory.limit
    if stated is not None:
        return explicit_limit(stated)
    return limit_from_snapshot(discover_memory(root))


def _budget_under(
    config: PipelineConfig,
    limit: MemoryLimit | None,
    *,
    pinned_in_use: int,
    pin_images: int,
    reserved: int,
    row_room: int,
) -> PageCacheBudget:
    """:func:`budget_for` under a limit already read (None: the config's stated budget)."""
    memory = config.memory
    pin = pin_bytes(config)
    if limit is None:
        assert memory.page_cache_budget is not None
        return fixed_budget(
            memory.page_cache_budget,
            pin_bytes=pin,
            copy_threads=config.copy_threads,
            knob_x=memory.knob_x,
            pin_images=pin_images,
            row_room=row_room,
        )
    return derive_budget(
        limit,
        pinned_in_use=pinned_in_use,
        pin_bytes=pin,
        copy_threads=config.copy_threads,
        safety_margin=memory.safety_margin,
        safety_fraction=memory.safety_fraction,
        knob_x=memory.knob_x,
        pin_images=pin_images,
        reserved=reserved,
        row_room=row_room,
    )


def make_plan(config: PipelineConfig, budget: PageCacheBudget) -> Plan:
    """Place layers by the config's policy and bind Group 2's KPUs inside the direct extent.

    Raises:
        ExtentOverflowError: the declared extent is too small for the direct KPUs.
    """
    layout = tensor_layout(config)
    layer_bytes = layer_page_cache_bytes(config)
    placement = place_layers(
        config.policy,
        layer_bytes,
        budget.page_cache_bytes,
        budget.knob_x_bytes,
        page_cache_order(len(layer_bytes), config.page_cache_layers),
    )
    target = config.storage.direct
    kpus = [(kpu, layout.image_bytes) for kpu in layer_kpus(placement.direct)]
    declared = target.extent_blocks()
    needed = len(kpus) * layout.n_blocks
    region = Region(Lba(target.first_lba), BlockCount(needed if declared is None else declared))
    lba_map = LbaMap.bind(kpus, region, target.lba_size)
    return Plan(config, config.shape(), layout, budget, placement, lba_map)
