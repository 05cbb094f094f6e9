"""The medium a KPU lives on, which names the path that moves its bytes: the plan's one word
for where things go.

The plan (:mod:`.placement`) names a medium for every layer; the store maps each medium to the
span that moves it, in one table. No code that moves bytes asks which policy is running.
"""

from __future__ import annotations

from enum import StrEnum


class Medium(StrEnum):
    """Where one layer's K and V live, and so how they move."""

    #: Group 2: a run of blocks on the direct target, moved through the ring around the page
    #: cache (O_DIRECT file, raw block device, NVMe passthrough).
    DIRECT = "direct"
    #: Group 1: a file of its own, buffered I/O through the ring; its pages stay cached (the
    #: budget made room for them).
    PAGE_CACHE = "page-cache"
    #: Group 1 beyond the budget (``cache-policy``): through the page cache, then written back
    #: and dropped after each use, so it cannot push the budgeted layers out.
    PAGE_CACHE_DROPPED = "page-cache-dropped"
    #: FlexLLMGen's baseline: the file through a shared memory map, a CPU copy each way.
    MMAP = "mmap"

    @property
    def uses_page_cache(self) -> bool:
        """Whether the bytes pass through the page cache (Group 1)."""
        return self is not Medium.DIRECT
