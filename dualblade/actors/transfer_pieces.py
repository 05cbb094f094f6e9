"""How a copy thread cuts one transfer into pieces.

A piece is the unit whose device copy (or host copy) may start before the storage transfer of the
transfer's next piece has ended. Each piece costs fixed Python, so pieces are few and large.
"""

from __future__ import annotations

#: Row-aligned pieces of a transfer, so that a piece's DMA (or host copy) overlaps the next one's
#: storage transfer; each costs fixed Python: at 1 MiB the page-cache path spent most of its time
#: there (1.5 GB/s against 7 GB/s for a plain cached read).
PIECE_BYTES = 4 << 20


def piece_bytes_for(*, cuda: bool, image_bytes: int) -> int:
    """How large a piece of one transfer is: the unit whose device copy (or host copy) may
    overlap the storage transfer of the next piece of the same transfer.

    With CUDA a transfer is one piece, its whole span (a span never exceeds its image), in an
    image of the buffer that is its own while it runs: it goes as a
    :class:`~dualblade.actors.chained_load.ChainedLoad`, read and copy chained on the engine's
    thread with no event-loop turn between them. In 64 MiB pieces an OPT-6.7B K or V (130 MiB)
    was three pieces, each a task on the loop; on an H100 the page-cache path moved 0.82 and 0.86
    of the machine's limit that way, 0.91 and 0.96 as one piece, alternated in one call
    (``pipebench --path page-cache``, docs/bench.md). With two images a thread's next read
    overlaps its last copy; with one its next read waits for that copy, while the other threads'
    reads go on. On the host pieces bound the copies' memory.
    """
    return image_bytes if cuda else PIECE_BYTES
