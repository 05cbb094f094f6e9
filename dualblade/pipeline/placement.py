"""Algorithm 1: which layers' KPUs take the page-cache path and which go NVMe-direct.

With the knob ``X ∈ [0, B_pc]``, ``n1`` layers, as many as fit in ``X`` whole (K and V
together), form Group 1 and use the page cache; every other layer forms Group 2 and bypasses it.
The paper takes layers ``0 .. n1-1``; the functions here take the first ``n1`` of an order
(:mod:`.layer_order`: by default spread over the model, so that a decode step's reads keep both
paths busy at once).
The page cache is then never asked to hold more than the budget, which is the point: once the KV
working set exceeds the page cache, LRU evicts exactly the tensor decode reads next and the hit
rate falls off a cliff; a working set that fits keeps its hits.

For equal-sized layers, ``n1 = floor(X / bytes(K_i + V_i))`` as in the paper. The function accepts
per-layer sizes and takes the longest prefix of the order that fits, which is the same for equal
sizes and stays correct if a model ever has layers of different widths.

The other policies of the evaluation are placements too: ``direct`` puts every layer in Group 2,
``page-cache``, ``cache-policy`` and ``baseline`` put every layer in Group 1. They differ in the
medium each layer gets (:class:`~.medium.Medium`): ``cache-policy`` keeps the layers Algorithm 1
would keep and drops the others' pages after each use; ``baseline`` maps its files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dualblade.pipeline.errors import PlanError
from dualblade.pipeline.medium import Medium


@dataclass(frozen=True)
class Placement:
    """Each layer's medium, and the bytes each layer will hold."""

    media: tuple[Medium, ...]
    layer_bytes: tuple[int, ...]
    knob_x_bytes: int
    policy: str

    @property
    def page_cache(self) -> tuple[int, ...]:
        """Group 1: the layers whose bytes pass through the page cache, ascending."""
        return tuple(i for i, medium in enumerate(self.media) if medium.uses_page_cache)

    @property
    def direct(self) -> tuple[int, ...]:
        """Group 2: the layers on the direct path, ascending."""
        return tuple(i for i, medium in enumerate(self.media) if medium is Medium.DIRECT)

    @property
    def n1(self) -> int:
        """How many layers take the page-cache path."""
        return len(self.page_cache)

    @property
    def page_cache_bytes(self) -> int:
        """Bytes of K and V in Group 1: at most X under the dual policy."""
        return sum(self.layer_bytes[layer] for layer in self.page_cache)

    @property
    def direct_bytes(self) -> int:
        """Bytes of K and V in Group 2."""
        return sum(self.layer_bytes[layer] for layer in self.direct)

    def medium_of(self, layer: int) -> Medium:
        """The medium of one layer.

        Raises:
            PlanError: the model has no such layer.
        """
        if not 0 <= layer < len(self.media):
            raise PlanError(f"layer {layer} is outside the model's {len(self.media)} layers")
        return self.media[layer]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (the layer lists themselves go under ``groups``)."""
        return {
            "policy": self.policy,
            "n1": self.n1,
            "knob_x_bytes": self.knob_x_bytes,
            "layer_kv_bytes": self.layer_bytes[0] if len(set(self.layer_bytes)) == 1 else None,
            "page_cache_bytes": self.page_cache_bytes,
            "direct_bytes": self.direct_bytes,
        }


def assign_groups(
    layer_bytes: Sequence[int],
    page_cache_budget: int,
    knob_x: int | None = None,
    order: Sequence[int] | None = None,
) -> Placement:
    """Algorithm 1: the first ``n1`` layers of ``order`` to the page cache, the rest
    NVMe-direct.

    Args:
        layer_bytes: ``bytes(K_i + V_i)`` of each layer (its page-cache footprint).
        page_cache_budget: ``B_pc``.
        knob_x: ``X``; None means ``B_pc``; clamped into ``[0, B_pc]``.
        order: every layer once, in the order they take the page cache
            (:func:`~.layer_order.page_cache_order`); None: layers ``0, 1, 2, ...``.

    Raises:
        PlanError: a layer size is not positive, the budget is negative, or ``order`` is not
            a permutation of the layers.
    """
    _check_sizes(layer_bytes)
    if page_cache_budget < 0:
        raise PlanError(f"the page-cache budget must not be negative (got {page_cache_budget})")
    ranked = _checked_order(order, len(layer_bytes))
    x = page_cache_budget if knob_x is None else max(0, min(knob_x, page_cache_budget))
    group1: set[int] = set()
    used = 0
    for layer in ranked:
        if used + layer_bytes[layer] > x:
            break
        used += layer_bytes[layer]
        group1.add(layer)
    media = tuple(
        Medium.PAGE_CACHE if layer in group1 else Medium.DIRECT for layer in range(len(layer_bytes))
    )
    return Placement(media, tuple(layer_bytes), x, "dual")


def _checked_order(order: Sequence[int] | None, num_layers: int) -> tuple[int, ...]:
    if order is None:
        return tuple(range(num_layers))
    if sorted(order) != list(range(num_layers)):
        raise PlanError(
            f"a page-cache order must name each of the {num_layers} layers once, got {list(order)}"
        )
    return tuple(order)


def place_layers(
    policy: str,
    layer_bytes: Sequence[int],
    page_cache_budget: int,
    knob_x: int | None = None,
    order: Sequence[int] | None = None,
) -> Placement:
    """The placement of a policy: ``dual`` runs Algorithm 1 (over ``order``: see
    :func:`assign_groups`), the others are fixed.

    Raises:
        PlanError: unknown policy, or invalid sizes (see :func:`assign_groups`).
    """
    if policy == "dual":
        return assign_groups(layer_bytes, page_cache_budget, knob_x, order)
    _check_sizes(layer_bytes)
    n = len(layer_bytes)
    if policy == "direct":
        return Placement((Medium.DIRECT,) * n, tuple(layer_bytes), 0, policy)
    if policy == "page-cache":
        return Placement((Medium.PAGE_CACHE,) * n, tuple(layer_bytes), sum(layer_bytes), policy)
    if policy == "baseline":
        return Placement((Medium.MMAP,) * n, tuple(layer_bytes), sum(layer_bytes), policy)
    if policy == "cache-policy":
        # Algorithm 1's n1 layers stay resident; the rest pass through and are dropped.
        kept = assign_groups(layer_bytes, page_cache_budget, knob_x, order).media
        media = tuple(
            Medium.PAGE_CACHE if m is Medium.PAGE_CACHE else Medium.PAGE_CACHE_DROPPED for m in kept
        )
        return Placement(media, tuple(layer_bytes), sum(layer_bytes), policy)
    raise PlanError(
        f"unknown policy {policy!r}; use dual, direct, page-cache, cache-policy or baseline"
    )


def _check_sizes(layer_bytes: Sequence[int]) -> None:
    bad = [i for i, size in enumerate(layer_bytes) if size <= 0]
    if bad:
        raise PlanError(f"layer sizes must be positive; layers {bad} are not")
