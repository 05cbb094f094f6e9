"""In which order layers take the page-cache path: which ``n1`` layers Algorithm 1's Group 1 is.

Algorithm 1 says how many layers fit the page-cache budget (``n1``); the paper then gives them
layers ``0 .. n1-1``. Which ones does not change a decode step's bytes, but it decides whether the
two paths run at the same time. A step reads the layers in order with a few reads in flight
ahead of the compute (as many as the store has copy threads), so with the page-cache layers all
first the step reads them while the disk idles, then the direct ones while the memory path
idles: the two paths add up instead of overlapping, and dual cannot come near the larger of its
two path times (measured in docs/bench.md: at 2 GiB the walk took the serial sum).

``spread`` (the default) orders the layers so that both groups lie spread over the model at every
share: the even layers first, then the odd ones. While the page cache holds at most half of the
layers, they are even layers in van der Corput order (bit-reversed counting, which halves the
gaps between the layers taken before it fills any of them); beyond half, the odd layers still
direct are the first of the odd layers' van der Corput order, so the few direct layers are the
ones spread out. Half and half alternate exactly. Any few consecutive layers then mix both paths
as far as the share allows, and the reads in flight keep the disk and the memory path busy
together. Prefixes nest, so one more layer for a context's share (a promotion) or one fewer (a
demotion) moves one layer, as the re-planner needs. ``leading`` is the paper's literal choice,
layers ``0 .. n1-1``.
"""

from __future__ import annotations

from functools import cache
from typing import Literal, get_args

LayerOrder = Literal["spread", "leading"]
LAYER_ORDERS: tuple[str, ...] = get_args(LayerOrder)


def page_cache_order(num_layers: int, how: LayerOrder = "spread") -> tuple[int, ...]:
    """Every layer ``0 .. num_layers-1`` once, in the order they take the page-cache path.

    Raises:
        ValueError: a negative ``num_layers`` or an unknown ``how``.
    """
    if num_layers < 0:
        raise ValueError(f"num_layers must not be negative, got {num_layers}")
    if how == "leading":
        return tuple(range(num_layers))
    if how == "spread":
        return _spread(num_layers)
    raise ValueError(f"unknown layer order {how!r}; use one of {', '.join(LAYER_ORDERS)}")


@cache
def _spread(num_layers: int) -> tuple[int, ...]:
    """The even layers in van der Corput order, then the odd ones in the reverse of theirs (see
    the module docstring)."""
    evens = range(0, num_layers, 2)
    odds = range(1, num_layers, 2)
    return tuple(evens[i] for i in _van_der_corput(len(evens))) + tuple(
        odds[i] for i in reversed(_van_der_corput(len(odds)))
    )


def _van_der_corput(n: int) -> tuple[int, ...]:
    """``0 .. n-1`` in the order that counting with reversed bits, scaled to ``n``, first names
    them: each next one lies in the middle of the widest gap left. Every index appears, as the
    ``2**bits >= n`` points scaled to ``n`` hit each of them."""
    if n == 0:
        return ()
    bits = max(1, (n - 1).bit_length())
    order: list[int] = []
    taken: set[int] = set()
    for k in range(1 << bits):
        index = int(format(k, f"0{bits}b")[::-1], 2) * n >> bits
        if index not in taken:
            taken.add(index)
            order.append(index)
    return tuple(order)
