"""Model shapes and the byte arithmetic of their KV cache.

The planner never needs weights, only how big each layer's K and V tensors get: a KV tensor of one
layer is ``[seq, batch, kv_heads * head_dim]`` in row-major order (FlexLLMGen's layout), so one
*row* (one token position of every sequence in the batch) is ``batch * kv_heads * head_dim *
itemsize`` bytes. Grouped-query attention (Llama-3, Qwen2.5) shrinks the KV cache by
``num_heads / num_kv_heads``; that is why the number of KV heads is a field of its own.

The presets carry the published architecture numbers of each model family's config.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dualblade.errors import ConfigError
from dualblade.pipeline.sizes import ByteCount

DType = Literal["float16", "bfloat16", "float32"]

#: Bytes per element of each KV dtype (named as torch names them, so ``getattr(torch, dtype)``
#: works for the layers above that do hold tensors).
DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class ModelShape:
    """The attention geometry of a decoder model: all the planner needs to size its KV cache."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: DType = "float16"

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"model {self.name}: {field} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model {self.name}: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention"
            )
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"model {self.name}: dtype must be one of {sorted(DTYPE_BYTES)}")

    @property
    def itemsize(self) -> int:
        """Bytes per element of the KV dtype."""
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_width(self) -> int:
        """Elements per token per sequence in one K (or V) tensor: ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    def row_bytes(self, batch: int) -> ByteCount:
        """Bytes of one row (one token position of every sequence) of one K or V tensor."""
        return ByteCount(batch * self.kv_width * self.itemsize)

    def kpu_bytes(self, batch: int, max_len: int) -> ByteCount:
        """Bytes of one layer's K tensor (equally its V tensor): one KV placement unit."""
        return ByteCount(max_len * self.row_bytes(batch))

    def layer_kv_bytes(self, batch: int, max_len: int) -> ByteCount:
        """Bytes of one layer's K plus V tensors: the unit Algorithm 1 places."""
        return ByteCount(2 * self.kpu_bytes(batch, max_len))

    def total_kv_bytes(self, batch: int, max_len: int) -> ByteCount:
        """The whole KV cache of all layers: the working set decode re-reads every step."""
        return ByteCount(self.num_layers * self.layer_kv_bytes(batch, max_len))


def _mha(name: str, layers: int, hidden: int, heads: int, dtype: DType = "float16") -> ModelShape:
    return ModelShape(name, layers, hidden, heads, heads, hidden // heads, dtype)


#: Shape presets by lower-case name. OPT: facebook/opt-* configs (fp16, multi-head attention);
#: opt-tiny is no published model but an OPT of four 64-wide layers for tests and demos that must
#: run real inference in seconds.
#: Llama-3-8B: 8 KV heads (GQA 4:1). Qwen2.5-7B: 4 KV heads (GQA 7:1), head_dim 128.
PRESETS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        _mha("opt-tiny", 4, 64, 4),
        _mha("opt-125m", 12, 768, 12),
        _mha("opt-350m", 24, 1024, 16),
        _mha("opt-1.3b", 24, 2048, 32),
        _mha("opt-2.7b", 32, 2560, 32),
        _mha("opt-6.7b", 32, 4096, 32),
        _mha("opt-13b", 40, 5120, 40),
        _mha("opt-30b", 48, 7168, 56),
        ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, "bfloat16"),
        ModelShape("qwen2.5-7b", 28, 3584, 28, 4, 128, "bfloat16"),
    )
}


def get_preset(name: str) -> ModelShape:
    """Look a preset up by name, case-insensitively.

    Raises:
        ConfigError: no preset has that name; the message lists the ones that exist.
    """
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(
            f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}"
        ) from None
