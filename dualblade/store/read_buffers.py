"""Reusable read buffers a context hands out, so that a read can land where the caller reads.

A decode step reads every layer back; a caller that reads into the same tensors every step
(``ctx.read(layer, out=...)``) saves a fresh allocation and its page faults per read. Buffers
made by the store go one step further on the host path: they are page-aligned (2 MiB-aligned
where transparent huge pages are on) and laid out like a KPU's image, so O_DIRECT and NVMe reads
land in them directly, and a direct KV byte crosses host memory once — no pinned buffer, no
copy out of it. On a GPU they are device tensors, and the copy threads' pinned buffers do the
Co-DMA as before.
"""

from __future__ import annotations

import torch

from dualblade.actors import Landing
from dualblade.io_engine import PAGE_SIZE, AlignedBuffer, IOEngine
from dualblade.store.tensor_shape import KVTensorShape


class ReadBuffers:
    """One layer's K and V read buffers: ``k`` and ``v`` are ``[max_len, batch, width]``.

    Make them with ``ctx.read_buffers()``; pass them as ``ctx.read(layer, out=buffers)``, which
    returns views of their first rows. Close them (or use ``with``) when done; on the host K and
    V share one aligned mapping, which stays mapped while any view of it is alive.
    """

    def __init__(
        self,
        rows: int,
        batch: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device,
        engine: IOEngine | None = None,
    ) -> None:
        self._shape = (rows, batch, width)
        self._engine: IOEngine | None = None
        self._dtype = dtype
        self._memory: AlignedBuffer | None = None
        self._landings: tuple[Landing | None, Landing | None] = (None, None)
        # The views the last read returned, and what they were checked for (see ``first_rows``).
        self._last_views: (
            tuple[tuple[int, KVTensorShape, torch.device], tuple[torch.Tensor, torch.Tensor]] | None
        ) = None
        if device.type == "cpu":
            nbytes = rows * batch * width * torch.empty((), dtype=dtype).element_size()
            # V's image starts on a fresh page, as aligned as K's (O_DIRECT needs the LBA size).
            v_offset = -(-nbytes // PAGE_SIZE) * PAGE_SIZE
            self._memory = AlignedBuffer(v_offset + nbytes)
            self._landings = (Landing(self._memory, 0), Landing(self._memory, v_offset))
            self.k, self.v = self._views()
            if engine is not None:
                self.fix_in(engine)
        else:
            self.k = torch.empty(self._shape, dtype=dtype, device=device)
            self.v = torch.empty(self._shape, dtype=dtype, device=device)

    def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
        memory, (k, v) = self._memory, self._landings
        assert memory is not None
        assert k is not None
        assert v is not None
        count = self._shape[0] * self._shape[1] * self._shape[2]
        return (
            memory.tensor(self._dtype, count=count, offset=k.offset).view(self._shape),
            memory.tensor(self._dtype, count=count, offset=v.offset).view(self._shape),
        )

    def first_rows(
        self, rows: int, shape: KVTensorShape, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``k`` and ``v``'s first ``rows`` rows, checked for a reader of ``shape`` on
        ``device`` (:meth:`KVTensorShape.out_views`) once for as long as it asks the same.

        A decode step reads every layer into the same buffers with the same row count; checking
        the buffers and slicing them again for each read was 8 % of the event loop's GIL time
        on the H200 machine (docs/pipeline-profile.md).

        Raises:
            KVShapeError: the buffers do not fit such a read.
        """
        key = (rows, shape, device)
        last = self._last_views
        if last is not None and last[0] == key:
            return last[1]
        views = shape.out_views((self.k, self.v), rows, device)
        self._last_views = (key, views)
        return views

    def fix_in(self, engine: IOEngine) -> bool:
        """Register the host memory with ``engine``'s ring (once), so that direct reads into
        it skip pinning its pages chunk by chunk: 11 % of a tmpfs read's rate
        (``io_engine/_fixed_buffers.py``). False on a GPU, or where the engine cannot (its
        reads work all the same); ``close`` gives the slot back. Buffers that outlive a store
        and serve the next one move to the new engine."""
        if self._engine is engine:
            return True
        if self._engine is not None and self._memory is not None:
            self._engine.remove_fixed_buffer(self._memory)  # nothing if that store is closed
            self._engine = None
        if self._memory is None or engine.add_fixed_buffer(self._memory) is not None:
            return False
        self._engine = engine
        return True

    @property
    def landings(self) -> tuple[Landing | None, Landing | None]:
        """Where ``k`` and ``v`` lie in aligned memory (None on a GPU)."""
        return self._landings

    def close(self) -> None:
        """Release the memory (idempotent).

        Raises:
            BufferError: a view of ``k`` or ``v`` is still alive elsewhere; nothing is released
                and the buffers stay usable.
        """
        self._last_views = None
        if self._memory is None:
            return
        del self.k, self.v
        try:
            self._memory.close()
        except BufferError:
            self.k, self.v = self._views()
            raise
        if self._engine is not None:  # the kernel holds the pages until the slot is given back
            self._engine.remove_fixed_buffer(self._memory)
            self._engine = None
        self._memory = None
        self._landings = (None, None)

    def __enter__(self) -> ReadBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
