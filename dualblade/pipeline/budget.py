"""The page-cache budget ``B_pc`` and the arithmetic that derives it, kept for display.

How ``B_pc`` is derived (DESIGN §2, the budgeter):

    B_pc = max(0, limit - in_use - N_threads * M_pin - reserved - margin)

- ``limit``: the memory limit the process runs under — the tighter of its cgroup's limit and the
  host's ``MemTotal``; without a cgroup limit, ``MemTotal``; or a limit given explicitly
  (``--memory-limit``, ``memory.limit``) to plan for a machine other than this one.
- ``in_use``: memory already taken that the page cache cannot reclaim: the cgroup's usage minus its
  file-backed LRU pages that no process maps (mapped ones are the processes' code and libraries)
  and its reclaimable kernel memory (cgroup v2: mostly the page cache's own metadata, which goes
  with the pages; see ``CgroupMemory.reclaimable_kernel_bytes``), raised if the *host* has less
  available than the cgroup would allow (a cgroup limit above what the host has free must not be
  spent twice). For an explicit limit it is 0: the plan is for a process that has not started yet.
- ``N_threads * M_pin``: one pinned KPU-sized buffer per copy thread (Co-DMA), page-locked and
  therefore never available to the page cache. The caller passes it while the buffers are not
  allocated yet; once they are, they already show up in ``in_use``.
- ``reserved``: memory the process has claimed but not touched yet, so that no reading counts it
  in use (an embedding application's own buffers, LMCache's L1): the caller says how much of it
  is still untouched at each reading, so it is counted once, whether touched or not.
- ``margin = max(safety_margin, safety_fraction * limit)``: headroom for the runtime's own
  allocations, the interpreter, and the kernel's reclaim watermarks; without it a budget that
  exactly fills the limit makes the kernel reclaim the very pages that were budgeted.

The knob ``X`` of Algorithm 1 is then clamped into ``[0, B_pc]``; unset, it is ``B_pc``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dualblade.pipeline.memory import MemorySnapshot


@dataclass(frozen=True)
class MemoryLimit:
    """The limit a budget is derived from, what of it is already in use, and where it came from."""

    limit_bytes: int
    in_use_bytes: int
    source: str


@dataclass(frozen=True)
class BudgetTerm:
    """One named line of the derivation, for tables: ``limit 6.00 GiB (explicit)``."""

    name: str
    nbytes: int
    note: str = ""


@dataclass(frozen=True)
class PageCacheBudget:
    """``B_pc``, the effective knob ``X`` and every term that produced them."""

    page_cache_bytes: int
    knob_x_bytes: int
    source: str
    limit_bytes: int | None
    in_use_bytes: int
    pin_bytes: int
    copy_threads: int
    safety_margin_bytes: int
    knob_x_requested_bytes: int | None
    #: Of the pinned reservation, the bytes already allocated when the limit was read, and so
    #: already inside ``in_use_bytes``: they are not subtracted a second time.
    pinned_in_use_bytes: int = 0
    #: KPU images per copy thread's buffer: 2 on CUDA, where a thread reads the next KPU into
    #: one image while the GPU copies the last one out of the other, unless the second image's
    #: memory would keep a layer out of the page cache (``planner.pin_images_in_plan``).
    pin_images: int = 1
    #: Memory claimed but not touched yet when the limit was read (not in ``in_use_bytes``).
    reserved_bytes: int = 0
    #: Bytes each copy thread's buffer holds beyond its images: the room for appended rows a
    #: CUDA copy thread stages in (``dualblade.actors``' row staging), 0 on the host.
    row_room_bytes: int = 0

    @property
    def pinned_reservation_bytes(self) -> int:
        """``N_threads × (images × M_pin + room for rows)``: the fixed DRAM cost of Co-DMA the
        paper admits, with the room a CUDA copy thread keeps for appended rows."""
        return self.copy_threads * (self.pin_images * self.pin_bytes + self.row_room_bytes)

    @property
    def pinned_still_reserved_bytes(self) -> int:
        """The part of the pinned reservation not yet inside ``in_use_bytes``."""
        return max(0, self.pinned_reservation_bytes - self.pinned_in_use_bytes)

    def terms(self) -> tuple[BudgetTerm, ...]:
        """The derivation as named lines, in the order of the formula."""
        if self.limit_bytes is None:
            lines = [BudgetTerm("page-cache budget B_pc", self.page_cache_bytes, self.source)]
        else:
            lines = [
                BudgetTerm("memory limit", self.limit_bytes, self.source),
                BudgetTerm("- in use, not page cache", self.in_use_bytes),
                BudgetTerm(
                    "- pinned reservation",
                    self.pinned_still_reserved_bytes,
                    f"{self.copy_threads} threads × "
                    + (f"{self.pin_images} images × " if self.pin_images > 1 else "")
                    + (
                        f"(M_pin {self.pin_bytes} B + rows {self.row_room_bytes} B)"
                        if self.row_room_bytes
                        else f"M_pin {self.pin_bytes} B"
                    )
                    + (
                        f", {self.pinned_in_use_bytes} B of it counted in use already"
                        if self.pinned_in_use_bytes
                        else ""
                    ),
                ),
                *(
                    [BudgetTerm("- reserved, not touched yet", self.reserved_bytes)]
                    if self.reserved_bytes
                    else []
                ),
                BudgetTerm("- safety margin", self.safety_margin_bytes),
                BudgetTerm("= page-cache budget B_pc", self.page_cache_bytes),
            ]
        note = (
            "X = B_pc"
            if self.knob_x_requested_bytes is None
            else f"requested {self.knob_x_requested_bytes} B, clamped to [0, B_pc]"
        )
        return (*lines, BudgetTerm("knob X", self.knob_x_bytes, note))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``page_cache_bytes`` first, then the derivation."""
        return {
            "page_cache_bytes": self.page_cache_bytes,
            "knob_x_bytes": self.knob_x_bytes,
            "source": self.source,
            "limit_bytes": self.limit_bytes,
            "in_use_bytes": self.in_use_bytes,
            "pinned_reservation_bytes": self.pinned_reservation_bytes,
            "pinned_in_use_bytes": self.pinned_in_use_bytes,
            "pin_bytes": self.pin_bytes,
            "pin_images": self.pin_images,
            "row_room_bytes": self.row_room_bytes,
            "copy_threads": self.copy_threads,
            "reserved_bytes": self.reserved_bytes,
            "safety_margin_bytes": self.safety_margin_bytes,
            "knob_x_requested_bytes": self.knob_x_requested_bytes,
        }


def explicit_limit(limit_bytes: int) -> MemoryLimit:
    """A limit given by the user: nothing is in use yet in the process being planned for."""
    return MemoryLimit(limit_bytes, 0, "explicit limit")


def limit_from_snapshot(snapshot: MemorySnapshot) -> MemoryLimit:
    """The limit and in-use memory of a discovered snapshot (see the module docstring)."""
    host = snapshot.host
    cgroup = snapshot.cgroup
    if cgroup is None or cgroup.limit_bytes is None:
        where = (
            f"host MemTotal (cgroup v{cgroup.version} {cgroup.path}: no limit)"
            if cgroup
            else ("host MemTotal (no memory cgroup)")
        )
        return MemoryLimit(host.total_bytes, host.total_bytes - host.available_bytes, where)
    limit = min(cgroup.limit_bytes, host.total_bytes)
    available = min(limit - cgroup.non_file_bytes, host.available_bytes)
    return MemoryLimit(limit, max(0, limit - available), f"cgroup v{cgroup.version} {cgroup.path}")


def derive_budget(
    limit: MemoryLimit,
    *,
    pin_bytes: int,
    copy_threads: int,
    safety_margin: int,
    safety_fraction: float,
    knob_x: int | None = None,
    pinned_in_use: int = 0,
    pin_images: int = 1,
    reserved: int = 0,
    row_room: int = 0,
) -> PageCacheBudget:
    """``B_pc = max(0, limit - in_use - copy_threads * (pin_images * pin_bytes + row_room) -
    reserved - margin)`` and ``X`` in it.

    ``pinned_in_use``: pinned bytes already allocated and counted in ``limit.in_use_bytes``
    (a running store reads its limit after allocating its buffers); only the rest of the
    reservation is subtracted, so the pinned memory is counted once. ``reserved``: memory
    claimed but not touched yet, so not in ``limit.in_use_bytes`` (see the module docstring).
    """
    margin = max(safety_margin, int(safety_fraction * limit.limit_bytes))
    reservation = copy_threads * (pin_images * pin_bytes + row_room)
    pinned = max(0, reservation - pinned_in_use)
    reserved = max(0, reserved)
    budget = max(0, limit.limit_bytes - limit.in_use_bytes - pinned - reserved - margin)
    return PageCacheBudget(
        page_cache_bytes=budget,
        knob_x_bytes=budget if knob_x is None else max(0, min(knob_x, budget)),
        source=limit.source,
        limit_bytes=limit.limit_bytes,
        in_use_bytes=limit.in_use_bytes,
        pin_bytes=pin_bytes,
        copy_threads=copy_threads,
        safety_margin_bytes=margin,
        knob_x_requested_bytes=knob_x,
        pinned_in_use_bytes=min(pinned_in_use, reservation),
        pin_images=pin_images,
        reserved_bytes=reserved,
        row_room_bytes=row_room,
    )


def fixed_budget(
    page_cache_bytes: int,
    *,
    pin_bytes: int,
    copy_threads: int,
    knob_x: int | None = None,
    pin_images: int = 1,
    row_room: int = 0,
) -> PageCacheBudget:
    """A budget the config states outright (``memory.page_cache_budget``): no derivation."""
    return PageCacheBudget(
        page_cache_bytes=page_cache_bytes,
        knob_x_bytes=page_cache_bytes if knob_x is None else max(0, min(knob_x, page_cache_bytes)),
        source="memory.page_cache_budget in the config",
        limit_bytes=None,
        in_use_bytes=0,
        pin_bytes=pin_bytes,
        copy_threads=copy_threads,
        safety_margin_bytes=0,
        knob_x_requested_bytes=knob_x,
        pin_images=pin_images,
        row_room_bytes=row_room,
    )
