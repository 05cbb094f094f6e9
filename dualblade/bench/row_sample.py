"""Which prompt rows the benches' read checks compare, gathered as an index tensor made once.

The sweep, pressure and serving workloads check every read on a sample of its prompt rows: the
first, every ``SAMPLE_STRIDE``-th and the last. The check runs on the event loop between a
layer's read and the next read into that layer's buffer, so whatever it costs sits on the
decode's path: it stands in for a model's compute, and the figures should carry the store's
cost, not the harness's. Gathered with a Python list (``read[[0, 61, ...]]``), the rows cost
0.1-0.2 ms per tensor, because torch turns the list into an index on every call; a check of
one K or V of the quick preset took 0.5-0.7 ms, so 64 checks took 30-45 ms of each 0.4 s
decode step at 2 GiB. With an index tensor made once, ``index_select`` gathers them in 0.01 ms.
Side by side (the quick preset at 2 GiB, dual, alternated rounds of ``--repeats 2``), the
decode's median fell from 2.09 to 1.96 s and its floor ratio's from 1.21 to 1.14
(docs/bench.md, *The sampled checks' rows gathered once*).
"""

from __future__ import annotations

import functools

import torch

#: Stride between the prompt rows checked (prime: it walks across LBA boundaries).
SAMPLE_STRIDE = 61


def sampled_row_list(prompt: int) -> list[int]:
    """The prompt rows a sampled check compares, in order: the first, every ``SAMPLE_STRIDE``-th
    and the last of ``prompt`` rows.

    Raises:
        ValueError: ``prompt`` is not positive.
    """
    if prompt < 1:
        raise ValueError(f"a sampled check needs at least one prompt row, got {prompt}")
    return sorted({0, prompt - 1, *range(0, prompt, SAMPLE_STRIDE)})


@functools.cache
def sampled_rows(prompt: int, device: str = "cpu") -> torch.Tensor:
    """:func:`sampled_row_list` as an index tensor on ``device``, made once per
    ``(prompt, device)`` and shared: callers pass it to ``index_select`` and never write it."""
    return torch.tensor(sampled_row_list(prompt), dtype=torch.long, device=device)


def sampled_from(read: torch.Tensor, prompt: int) -> torch.Tensor:
    """The sampled prompt rows of ``read`` (its first dimension), on the host: only they cross
    from a GPU (a whole layer copied to pageable memory on the event loop's thread stalled
    every transfer in flight for tens of milliseconds)."""
    return read.index_select(0, sampled_rows(prompt, str(read.device))).cpu()
