"""Aligned, DMA-ready host buffers that are torch tensors without copies.

Why anonymous mmap memory: it is page-aligned (O_DIRECT and NVMe need at least the LBA size),
it can be 2 MiB-aligned and backed by transparent huge pages, and Python's ``mmap`` refuses to
close while any exported view (a tensor, a ctypes pointer) still aliases it, so a use-after-free
becomes a ``BufferError`` instead of memory corruption.

Why huge pages: one storage command may span at most ``max_segments`` physically separate
pages (254 on a virtio disk, 127 on QEMU's NVMe). A 1 MiB transfer from 4 KiB pages needs 256
segments and is split by the block layer (or refused by NVMe passthrough); from 2 MiB pages it
is one or two segments.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
import threading
from typing import TYPE_CHECKING, Final

from dualblade.io_engine.errors import BufferBusyError, IOEngineError

if TYPE_CHECKING:
    import torch

PAGE_SIZE: Final = mmap.PAGESIZE
HUGE_PAGE_SIZE: Final = 2 * 1024 * 1024


def _thp_available() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return "[never]" not in mode


class AlignedBuffer:
    """A page-aligned (2 MiB-aligned when ``huge``) host buffer, pre-faulted.

    The buffer counts the requests whose chunks the kernel may be touching (``begin_io`` when a
    request on it is created, ``end_io`` when its last completion is reaped);
    :meth:`close` raises :class:`BufferBusyError` while any is in flight, so memory is never
    unmapped under DMA.

    Args:
        size: usable bytes; rounded up to whole pages.
        huge: ask for 2 MiB alignment and ``MADV_HUGEPAGE`` (ignored where THP is off).
    """

    def __init__(self, size: int, *, huge: bool = True) -> None:
        if size <= 0:
            raise ValueError(f"buffer size must be positive, got {size}")
        self.size = -(-size // PAGE_SIZE) * PAGE_SIZE
        self.huge = huge and _thp_available() and self.size >= HUGE_PAGE_SIZE
        alignment = HUGE_PAGE_SIZE if self.huge else PAGE_SIZE
        try:
            # Private: anonymous memory of this process, as a memory limit counts it (a
            # shared mapping is shmem, which cgroups report as page cache as well).
            self._map = mmap.mmap(
                -1,
                self.size + alignment - PAGE_SIZE,
                flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
            )
        except (OSError, OverflowError) as error:
            reason = error.strerror if isinstance(error, OSError) else "too large"
            raise IOEngineError(
                f"cannot allocate a {self.size}-byte I/O buffer: {reason} (the pinned buffers "
                "hold one KPU each: lower batch, max length or copy_threads)"
            ) from None
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._start = (-base) % alignment
        if self.huge and hasattr(mmap, "MADV_HUGEPAGE"):
            # Advise only the aligned span: partial huge pages at the edges are wasted anyway.
            with contextlib.suppress(OSError):
                self._map.madvise(mmap.MADV_HUGEPAGE, self._start, self.size)
        self._view: memoryview | None = memoryview(self._map)[self._start : self._start + self.size]
        self.address: int = base + self._start
        # Fault every page in now, so the first DMA does not pay for page allocation.
        ctypes.memset(self.address, 0, self.size)
        self._inflight = 0
        self._lock = threading.Lock()
        self._cuda_registered = False

    # -- views --------------------------------------------------------------------------------
    @property
    def view(self) -> memoryview:
        """A writable memoryview of the usable bytes."""
        if self._view is None:
            raise BufferBusyError("buffer is closed")
        return self._view

    def tensor(
        self, dtype: torch.dtype | None = None, count: int = -1, offset: int = 0
    ) -> torch.Tensor:
        """A 1-D torch tensor aliasing the buffer (no copy); keeps the buffer mapped while alive."""
        import torch

        return torch.frombuffer(self.view, dtype=dtype or torch.uint8, count=count, offset=offset)

    # -- DMA accounting (called by the engine) -----------------------------------------------
    def begin_io(self) -> None:
        """Note that a request may now have the kernel read or write this buffer."""
        with self._lock:
            if self._view is None:
                raise BufferBusyError("I/O submitted on a closed buffer")
            self._inflight += 1

    def end_io(self) -> None:
        """Note that a request on this buffer has finished (its last CQE was reaped)."""
        with self._lock:
            assert self._inflight > 0, "end_io without begin_io"
            self._inflight -= 1

    @property
    def inflight(self) -> int:
        """Requests whose I/O may still touch this buffer."""
        return self._inflight

    # -- CUDA ---------------------------------------------------------------------------------
    def pin_for_cuda(self) -> bool:
        """Page-lock the buffer for CUDA DMA (``cudaHostRegister``); False without CUDA."""
        import torch

        if self._cuda_registered:
            return True
        if not torch.cuda.is_available():
            return False
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        result = cudart.cudaHostRegister(self.address, self.size, 0)
        if int(result) != 0:
            raise BufferBusyError(f"cudaHostRegister of {self.size} bytes failed: {result}")
        self._cuda_registered = True
        return True

    @property
    def cuda_registered(self) -> bool:
        """Page-locked with ``cudaHostRegister`` (GPU copies from it are true DMA)."""
        return self._cuda_registered

    # -- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap the buffer.

        A view that nothing uses may still be held by a reference cycle: the frames in the
        traceback of a task cancelled while it moved the buffer's bytes, say, alive until the
        collector runs (a store stopping mid-load was refused in 8 of 35 tries on a loaded
        machine). That view is garbage, not a user of the buffer, so a refused close collects
        once and tries again. The collection runs outside the lock, where a finalizer it calls
        may take it. Only this failure path pays for it.

        Raises:
            BufferBusyError: an I/O on the buffer is still in flight.
            BufferError: a tensor or view still aliases the buffer.
        """
        try:
            self._unmap()
        except BufferError:
            gc.collect()
            self._unmap()

    def _unmap(self) -> None:
        with self._lock:
            if self._view is None:
                return
            if self._inflight:
                raise BufferBusyError(
                    f"buffer has {self._inflight} I/O operation(s) in flight; cannot release it"
                )
            if self._cuda_registered:
                import torch

                cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
                cudart.cudaHostUnregister(self.address)
                self._cuda_registered = False
            # Drop our view without ``release()``: a tensor from :meth:`tensor` holds a slice of
            # it, and releasing would let the mapping go while the tensor still points into it.
            self._view = None
            try:
                self._map.close()
            except BufferError:
                self._view = memoryview(self._map)[self._start : self._start + self.size]
                raise BufferError(
                    "a tensor or memoryview still aliases this buffer; drop it before close()"
                ) from None

    @property
    def closed(self) -> bool:
        return self._view is None

    def __enter__(self) -> AlignedBuffer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self.close()
            return
        # An exception is on its way out, and the frames of its traceback may be what still
        # aliases the buffer (a failed assertion keeps its operands): "still aliases" raised
        # here would replace it, and the caller would see that instead of why the block failed.
        # The buffer then stays mapped until it is collected.
        with contextlib.suppress(BufferError):
            self.close()

    def __repr__(self) -> str:
        return f"AlignedBuffer(size={self.size}, huge={self.huge}, address=0x{self.address:x})"


class BorrowedBuffer(AlignedBuffer):
    """Host memory that a caller allocated (a contiguous CPU tensor), as an I/O buffer.

    Why: memory the caller already holds at the target's alignment (LMCache's L1 with
    ``--l1-align-bytes 4096``, say) can take reads straight from storage, with no staging
    buffer and no copy out of it. The buffer keeps the tensor alive and counts the I/O in
    flight as an :class:`AlignedBuffer` does, so :meth:`close` refuses while the kernel may
    still write into it; closing drops the reference and frees nothing. Whether the address
    suits a target is the target's check (``Target.check_io``), made when a request is built.

    ``nbytes``: only the tensor's first ``nbytes`` (default: all of it).

    Raises:
        ValueError: the tensor is empty, not on the CPU, or not contiguous; ``nbytes`` is not
            within ``1..`` its size.
    """

    def __init__(self, owner: torch.Tensor, nbytes: int | None = None) -> None:
        if owner.device.type != "cpu" or not owner.is_contiguous() or owner.numel() == 0:
            raise ValueError("a borrowed buffer needs a non-empty, contiguous CPU tensor")
        whole = owner.numel() * owner.element_size()
        if nbytes is not None and not 0 < nbytes <= whole:
            raise ValueError(f"a borrowed buffer of {nbytes} bytes from a {whole}-byte tensor")
        self._owner: torch.Tensor | None = owner
        self.size = whole if nbytes is None else nbytes
        self.huge = False
        self.address = owner.data_ptr()
        raw = (ctypes.c_char * self.size).from_address(self.address)
        self._view = memoryview(raw).cast("B")
        self._inflight = 0
        self._lock = threading.Lock()
        self._cuda_registered = False

    def pin_for_cuda(self) -> bool:
        """Never: the memory is the caller's to pin (or not)."""
        return False

    def close(self) -> None:
        """Drop the reference to the caller's tensor (idempotent).

        Raises:
            BufferBusyError: an I/O on the buffer is still in flight.
        """
        with self._lock:
            if self._inflight:
                raise BufferBusyError(
                    f"buffer has {self._inflight} I/O operation(s) in flight; cannot release it"
                )
            self._view = None
            self._owner = None
