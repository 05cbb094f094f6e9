"""The KV placement unit (KPU): one layer's K tensor or its V tensor.

The paper's unit of placement and of pinned buffering: Algorithm 1 places a layer's two KPUs
together, the LBA map gives each direct KPU its own extent, and one copy thread's pinned buffer
holds exactly one KPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from dualblade.errors import ConfigError

TensorKind = Literal["K", "V"]
_NAME = re.compile(r"^L(\d+)\.([KV])$")


@dataclass(frozen=True, order=True)
class KpuId:
    """Names one KPU; orders as the device lays them out: by layer, K before V."""

    layer: int
    tensor: TensorKind

    def __post_init__(self) -> None:
        if self.layer < 0 or self.tensor not in ("K", "V"):
            raise ConfigError(f"not a KPU: layer {self.layer}, tensor {self.tensor!r}")

    def __str__(self) -> str:
        return f"L{self.layer}.{self.tensor}"

    @classmethod
    def parse(cls, text: str) -> KpuId:
        """Read back ``str(kpu)``, e.g. ``"L12.V"``.

        Raises:
            ConfigError: the text is not ``L<layer>.K`` or ``L<layer>.V``.
        """
        match = _NAME.match(text)
        if match is None:
            raise ConfigError(f"{text!r} is not a KPU name like 'L3.K' or 'L3.V'")
        tensor: TensorKind = "K" if match.group(2) == "K" else "V"
        return cls(int(match.group(1)), tensor)


def layer_kpus(layers: list[int] | tuple[int, ...]) -> tuple[KpuId, ...]:
    """The KPUs of the given layers in device order: ``L0.K, L0.V, L1.K, ...``."""
    return tuple(KpuId(layer, tensor) for layer in sorted(layers) for tensor in ("K", "V"))
