"""The binder actor: the book of who owns which blocks and files, materialized on first access.

Binding is logical when a context opens; the binder turns it into storage the first time the
context touches it: a contiguous run of blocks on the direct target for all of the context's
direct KPUs, and one page-cache file per page-cache KPU. When the context closes, the binder
deallocates what it materialized — TRIM (punch hole, BLKDISCARD or NVMe Dataset Management) on
the direct run, unlink for the files — so the device is told the blocks hold nothing and the next
context starts clean. It never hands out a block outside the configured extent.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dualblade.actors._base import Actor, Reply
from dualblade.actors._extents import ExtentAllocator
from dualblade.io_engine import IOEngine, PageCacheFile, Target
from dualblade.logs import get_logger
from dualblade.telemetry import NULL_TRACER, Tracer

_log = get_logger(__name__)


@dataclass(frozen=True)
class ClaimExtent:
    """Give ``context`` a contiguous run of ``n_blocks``; the reply is its first LBA."""

    context: int
    n_blocks: int
    reply: Reply[int]


@dataclass(frozen=True)
class ClaimFile:
    """Create (or return) the page-cache file ``name`` of ``context`` with ``size`` bytes.

    ``folder``: the sub-folder it goes in (default ``context-<context>``). A context that
    holds each layer's files as a holding of their own keeps them in its one folder this way.
    """

    context: int
    name: str
    size: int
    reply: Reply[PageCacheFile]
    folder: str | None = None


@dataclass(frozen=True)
class ReleaseContext:
    """Deallocate everything ``context`` materialized; the reply says what was released."""

    context: int
    reply: Reply[Released]


@dataclass(frozen=True)
class Released:
    """What one context held."""

    trimmed_blocks: int
    files: int


@dataclass(frozen=True)
class GetBook:
    """A snapshot of the book (for tests and ``doctor``-style reports)."""

    reply: Reply[Book]


@dataclass(frozen=True)
class Book:
    """Direct runs per context (first LBA, blocks) and page-cache files per context."""

    extents: dict[int, tuple[int, int]]
    files: dict[int, list[str]]
    region: tuple[int, int]  # first LBA, end LBA (exclusive) of what may be handed out
    file_bytes: dict[int, int] = field(default_factory=lambda: {})  # page-cache bytes per context


BinderMessage = ClaimExtent | ClaimFile | ReleaseContext | GetBook


@dataclass
class _ContextHoldings:
    extent: tuple[int, int] | None = None
    files: dict[str, PageCacheFile] = field(default_factory=dict)
    folder: Path | None = None


class BinderActor(Actor[BinderMessage]):
    """Owns the direct target's block allocation and the page-cache files.

    Args:
        engine: used to TRIM the direct target.
        direct: the direct target (its LBA is ``offset // lba_size``).
        first_lba: the first block dualblade may use.
        n_blocks: blocks of the configured extent, or None for a file that grows to fit.
        page_cache_dir: folder of the page-cache files (one sub-folder per context).
        file_factory: makes a page-cache file from its path and size (fault injection swaps in
            :class:`~dualblade.testing.FaultyPageCacheFile`).
    """

    def __init__(
        self,
        engine: IOEngine,
        direct: Target,
        first_lba: int,
        n_blocks: int | None,
        page_cache_dir: Path,
        *,
        tracer: Tracer = NULL_TRACER,
        file_factory: Callable[[Path, int], PageCacheFile] = PageCacheFile,
    ) -> None:
        # Refuse a bad extent before the mailbox exists: a refused binder leaks no stream.
        growable = n_blocks is None
        if not growable:
            assert n_blocks is not None
            limit = direct.size // direct.lba_size
            if first_lba + n_blocks > limit:
                from dualblade.io_engine import TargetError

                raise TargetError(
                    f"the configured extent [{first_lba}, {first_lba + n_blocks}) runs past the "
                    f"end of {direct.name} ({limit} blocks of {direct.lba_size} bytes)"
                )
        super().__init__("binder", tracer=tracer)
        self.engine = engine
        self.direct = direct
        self.lba_size = direct.lba_size
        self.allocator = ExtentAllocator(first_lba, n_blocks or 0, growable=growable)
        self.page_cache_dir = page_cache_dir
        self.file_factory = file_factory
        self._held: dict[int, _ContextHoldings] = {}
        self.trimmed_blocks = 0

    async def handle(self, message: BinderMessage) -> None:
        if isinstance(message, ClaimExtent):
            holdings = self._held.setdefault(message.context, _ContextHoldings())
            if holdings.extent is None:
                with self.tracer.span(self.name, "claim extent", blocks=message.n_blocks):
                    start = self.allocator.allocate(message.n_blocks)
                    try:
                        self._grow_file_target()
                    except BaseException:
                        # No room for it (ENOSPC): the run was never the context's; give it back.
                        self.allocator.free(start)
                        raise
                holdings.extent = (start, message.n_blocks)
            message.reply.set(holdings.extent[0])
        elif isinstance(message, ClaimFile):
            holdings = self._held.setdefault(message.context, _ContextHoldings())
            target = holdings.files.get(message.name)
            if target is None:
                if holdings.folder is None:
                    name = message.folder or f"context-{message.context}"
                    holdings.folder = self.page_cache_dir / name
                with self.tracer.span(self.name, "create file", file=message.name):
                    target = self.file_factory(holdings.folder / message.name, message.size)
                holdings.files[message.name] = target
            message.reply.set(target)
        elif isinstance(message, ReleaseContext):
            message.reply.set(await self._release(message.context))
        elif isinstance(message, GetBook):
            message.reply.set(self.book())

    def book(self) -> Book:
        """What is held now. The binder's state only changes on the event loop's thread, so a
        caller on that thread may read it directly (the store's stats do)."""
        held = self._held.items()
        return Book(
            extents={c: h.extent for c, h in held if h.extent is not None},
            files={c: sorted(h.files) for c, h in held if h.files},
            region=(self.allocator.first, self.allocator.end),
            file_bytes={c: sum(f.size for f in h.files.values()) for c, h in held if h.files},
        )

    def _grow_file_target(self) -> None:
        # Any target that can grow (a DirectFile, or a wrapper of one such as FaultyTarget).
        grow = getattr(self.direct, "grow_to", None)
        if self.allocator.growable and grow is not None:
            grow(self.allocator.end * self.lba_size)

    async def _release(self, context: int) -> Released:
        holdings = self._held.pop(context, None)
        if holdings is None:
            return Released(0, 0)
        trimmed = 0
        try:
            if holdings.extent is not None:
                start, n_blocks = holdings.extent
                with self.tracer.span(self.name, "trim", blocks=n_blocks, context=context):
                    await self.engine.trim(
                        self.direct, start * self.lba_size, n_blocks * self.lba_size
                    )
                trimmed = n_blocks
                self.trimmed_blocks += n_blocks
        finally:
            # Free the run even if TRIM failed: the data is dead either way.
            if holdings.extent is not None:
                self.allocator.free(holdings.extent[0])
            for name, target in holdings.files.items():
                target.close()
                assert holdings.folder is not None
                (holdings.folder / name).unlink(missing_ok=True)
            # The folder goes with its last file (other holdings may share it).
            if holdings.folder is not None:
                with contextlib.suppress(OSError):
                    holdings.folder.rmdir()
        return Released(trimmed, len(holdings.files))

    async def on_stop(self) -> None:
        for context in list(self._held):
            try:
                await self._release(context)
            except Exception as error:  # shutting down: report, keep releasing
                _log.warning("release on shutdown failed", context=context, error=str(error))
        if self.page_cache_dir.is_dir() and not any(self.page_cache_dir.iterdir()):
            os.rmdir(self.page_cache_dir)
