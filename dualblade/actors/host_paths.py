"""Host-side loads and stores that skip a copy thread's pinned buffer.

Without CUDA the "device" is host memory, and staging every byte through the pinned buffer would
copy it twice. These two checks say when a transfer can move the caller's own memory instead;
the copy thread then holds a storage slot and moves it (``CopyThreadActor``).
"""

from __future__ import annotations

import torch

from dualblade.actors.copy_messages import CopyMessage, Load, StorageSpan
from dualblade.io_engine import AlignedBuffer


def landing_for(message: CopyMessage, *, cuda: bool) -> tuple[StorageSpan, AlignedBuffer] | None:
    """The span moved into the caller's aligned memory, if a load can land there directly.

    Only without CUDA (with a GPU the pinned buffer is the DMA's source: Co-DMA), only for
    unpadded rows (the caller's tensor has no gaps between rows), and only where the
    destination sits in the landing memory exactly where the span puts its rows.
    """
    if cuda or not isinstance(message, Load) or message.landing is None:
        return None
    landing, view, span = message.landing, message.view, message.span
    start = landing.offset + span.buffer_offset
    if (
        view.row_stride != view.row_bytes
        or not message.destination.is_contiguous()
        or message.destination.data_ptr() != landing.buffer.address + start
        or start + span.nbytes > landing.buffer.size
    ):
        return None
    return span.at(start), landing.buffer


def host_tensor_for(message: CopyMessage, *, cuda: bool) -> torch.Tensor | None:
    """The host tensor a transfer can move straight to or from storage, or None.

    Without CUDA the "device" is host memory: a page-cache or mmap span whose rows are not
    padded reads into (or writes from) the caller's tensor itself, one copy instead of two
    through the pinned buffer. The direct path always stages: O_DIRECT needs its alignment.
    """
    if cuda or not getattr(message.span, "host_direct", False):
        return None
    view = message.view
    tensor = message.destination if isinstance(message, Load) else message.source
    if (
        tensor.device.type != "cpu"
        or not tensor.is_contiguous()
        or view.row_stride != view.row_bytes
        or tensor.numel() * tensor.element_size() != message.span.nbytes
    ):
        return None
    return tensor
