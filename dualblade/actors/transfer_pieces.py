"""How a copy thread cuts one transfer into pieces.

A piece is the unit whose device copy (or host copy) may start before the storage transfer of the
transfer's next piece has ended. Each piece costs fixed Python, so pieces are few and large.
"""

from __future__ import annotations

#: Row-aligned pieces of a transfer, so that a piece's DMA (or host copy) overlaps the next one's
#: storage transfer; each costs fixed Python: at 1 MiB the page-cache path spent most of its time
#: there (1.5 GB/s against 7 GB/s for a plain cached read).
PIECE_BYTES = 4 << 20
#: Pieces for CUDA copies through a one-image buffer (~0.1-0.3 ms of Python each against 20 us
#: per MiB at 50 GB/s): on the H200 a resident OPT-6.7B cache reached the GPU at 7.4-8.8 GB/s in
#: 8 MiB pieces, 18-20 in 64 MiB, the last piece's DMA trailing its read by 1.4 ms (a disk read of
#: it takes 34 ms). A two-image buffer does not cut CUDA transfers at all (:func:`piece_bytes_for`).
CUDA_PIECE_BYTES = 64 << 20


def piece_bytes_for(*, cuda: bool, images: int, image_bytes: int) -> int:
    """How large a piece of one transfer is: the unit whose device copy (or host copy) may
    overlap the storage transfer of the next piece of the same transfer.

    With CUDA and a buffer of two images a transfer is one piece, its whole span (a span never
    exceeds its image): the two images already overlap one transfer's read with the last one's
    copy, and a load of one piece runs as a
    :class:`~dualblade.actors.chained_load.ChainedLoad`, read and copy chained on the engine's
    thread with no event-loop turn between them. In 64 MiB pieces an OPT-6.7B K or V
    (130 MiB) was three pieces, each a task on the loop; on an H100 the page-cache path moved
    0.82 and 0.86 of the machine's limit that way, 0.91 and 0.96 as one piece, alternated in
    one call (``pipebench --path page-cache``, docs/bench.md). With one image, pieces are what
    overlaps the reads with the copies; on the host they bound the copies' memory.
    """
    if not cuda:
        return PIECE_BYTES
    return image_bytes if images > 1 else CUDA_PIECE_BYTES
