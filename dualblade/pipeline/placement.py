"""Algorithm 1: which layers' KPUs take the page-cache path and which go NVMe-direct.

With the knob ``X ∈ [0, B_pc]``, the first ``n1`` layers, as many as fit in ``X`` whole (K and V
together), form Group 1 and use the page cache; every other layer forms Group 2 and bypasses it.
The page cache is then never asked to hold more than the budget, which is the point: once the KV
working set exceeds the page cache, LRU evicts exactly the tensor decode reads next and the hit
rate falls off a cliff; a working set that fits keeps its hits.

For equal-sized layers, ``n1 = floor(X / bytes(K_i + V_i))`` as in the paper. The function accepts
per-layer sizes and takes the longest prefix that fits, which is the same for equal sizes and stays
correct if a model ever has layers of different widths.

The other policies of the evaluation are placements too: ``direct`` puts every layer in Group 2,
``page-cache``, ``cache-policy`` and ``baseline`` put every layer in Group 1 (they differ in how
the page-cache path behaves, not in where tensors go).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dualblade.pipeline.errors import PlanError

Group = Literal["page_cache", "direct"]


@dataclass(frozen=True)
class Placement:
    """The two groups of layers, in ascending order, and the bytes each will hold."""

    page_cache: tuple[int, ...]
    direct: tuple[int, ...]
    layer_bytes: tuple[int, ...]
    knob_x_bytes: int
    policy: str

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

    def group_of(self, layer: int) -> Group:
        """The group of one layer.

        Raises:
            PlanError: the model has no such layer.
        """
        if not 0 <= layer < len(self.layer_bytes):
            raise PlanError(f"layer {layer} is outside the model's {len(self.layer_bytes)} layers")
        return "page_cache" if layer in self.page_cache else "direct"

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
    layer_bytes: Sequence[int], page_cache_budget: int, knob_x: int | None = None
) -> Placement:
    """Algorithm 1: layers ``0 .. n1-1`` to the page cache, the rest NVMe-direct.

    Args:
        layer_bytes: ``bytes(K_i + V_i)`` of each layer (its page-cache footprint).
        page_cache_budget: ``B_pc``.
        knob_x: ``X``; None means ``B_pc``; clamped into ``[0, B_pc]``.

    Raises:
        PlanError: a layer size is not positive or the budget is negative.
    """
    _check_sizes(layer_bytes)
    if page_cache_budget < 0:
        raise PlanError(f"the page-cache budget must not be negative (got {page_cache_budget})")
    x = page_cache_budget if knob_x is None else max(0, min(knob_x, page_cache_budget))
    n1, used = 0, 0
    for size in layer_bytes:
        if used + size > x:
            break
        used += size
        n1 += 1
    layers = tuple(range(len(layer_bytes)))
    return Placement(layers[:n1], layers[n1:], tuple(layer_bytes), x, "dual")


def place_layers(
    policy: str, layer_bytes: Sequence[int], page_cache_budget: int, knob_x: int | None = None
) -> Placement:
    """The placement of a policy: ``dual`` runs Algorithm 1, the others are fixed.

    Raises:
        PlanError: unknown policy, or invalid sizes (see :func:`assign_groups`).
    """
    if policy == "dual":
        return assign_groups(layer_bytes, page_cache_budget, knob_x)
    _check_sizes(layer_bytes)
    layers = tuple(range(len(layer_bytes)))
    if policy == "direct":
        return Placement((), layers, tuple(layer_bytes), 0, policy)
    if policy in ("page-cache", "cache-policy", "baseline"):
        return Placement(layers, (), tuple(layer_bytes), sum(layer_bytes), policy)
    raise PlanError(
        f"unknown policy {policy!r}; use dual, direct, page-cache, cache-policy or baseline"
    )


def _check_sizes(layer_bytes: Sequence[int]) -> None:
    bad = [i for i, size in enumerate(layer_bytes) if size <= 0]
    if bad:
        raise PlanError(f"layer sizes must be positive; layers {bad} are not")
