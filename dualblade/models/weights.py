"""An OPT decoder's parameters: their names and shapes, and deterministic random ones.

Tensors are kept in one flat mapping under Hugging Face's OPT names with the ``model.decoder.``
prefix dropped (``layers.3.self_attn.q_proj.weight``), so a checkpoint loads by renaming nothing
and the engine reads each layer as a small typed record.

Random weights exist because no model hub is reachable here: they make real inference — with
real attention over the offloaded KV cache — reproducible from a seed. Their scale is chosen so
the output is not degenerate: with the usual 0.02 everywhere the residual stream of a tied-
embedding model stays near a few directions and greedy decoding repeats one or two tokens.
Linear weights get ``2/sqrt(fan_in)`` and LayerNorms a 0.2 spread around the identity instead:
measured on opt-tiny, 16 greedy tokens are then 10-14 distinct per sequence (2-5 with 0.02), so
every layer, and every cached K and V, decides the next token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from dualblade.errors import ConfigError
from dualblade.models.architecture import POSITION_OFFSET, OptArchitecture

_LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj")
_LAYER_NORMS = ("self_attn_layer_norm", "final_layer_norm")


def parameter_shapes(arch: OptArchitecture) -> dict[str, tuple[int, ...]]:
    """Every parameter the architecture has, by name, with its shape."""
    h, f = arch.hidden_size, arch.ffn_dim
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (arch.vocab_size, arch.embed_dim),
        "embed_positions.weight": (arch.max_positions + POSITION_OFFSET, h),
    }
    if arch.layer_norm_before:
        shapes["final_layer_norm.weight"] = (h,)
        shapes["final_layer_norm.bias"] = (h,)
    if arch.word_embed_dim is not None:
        shapes["project_in.weight"] = (h, arch.embed_dim)
        shapes["project_out.weight"] = (arch.embed_dim, h)
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        for linear in _LAYER_LINEARS:
            shapes[p + linear + ".weight"] = (h, h)
            shapes[p + linear + ".bias"] = (h,)
        for norm in _LAYER_NORMS:
            shapes[p + norm + ".weight"] = (h,)
            shapes[p + norm + ".bias"] = (h,)
        shapes[p + "fc1.weight"] = (f, h)
        shapes[p + "fc1.bias"] = (f,)
        shapes[p + "fc2.weight"] = (h, f)
        shapes[p + "fc2.bias"] = (h,)
    return shapes


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's parameters, as the engine uses them."""

    q_w: torch.Tensor
    q_b: torch.Tensor
    k_w: torch.Tensor
    k_b: torch.Tensor
    v_w: torch.Tensor
    v_b: torch.Tensor
    o_w: torch.Tensor
    o_b: torch.Tensor
    attn_ln_w: torch.Tensor
    attn_ln_b: torch.Tensor
    fc1_w: torch.Tensor
    fc1_b: torch.Tensor
    fc2_w: torch.Tensor
    fc2_b: torch.Tensor
    ffn_ln_w: torch.Tensor
    ffn_ln_b: torch.Tensor


@dataclass(frozen=True)
class OptWeights:
    """All parameters of one OPT decoder, checked against its architecture."""

    arch: OptArchitecture
    tensors: Mapping[str, torch.Tensor]

    def __post_init__(self) -> None:
        expected = parameter_shapes(self.arch)
        missing = sorted(set(expected) - set(self.tensors))
        if missing:
            shown = ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else "")
            raise ConfigError(f"model {self.arch.name}: missing {len(missing)} tensors: {shown}")
        for name, shape in expected.items():
            if tuple(self.tensors[name].shape) != shape:
                raise ConfigError(
                    f"model {self.arch.name}: {name} has shape "
                    f"{list(self.tensors[name].shape)}, expected {list(shape)}"
                )

    def get(self, name: str) -> torch.Tensor | None:
        """A parameter, or None where the architecture has none of that name."""
        return self.tensors.get(name)

    def layer(self, index: int) -> LayerWeights:
        """Layer ``index``'s parameters."""
        t, p = self.tensors, f"layers.{index}."
        return LayerWeights(
            q_w=t[p + "self_attn.q_proj.weight"],
            q_b=t[p + "self_attn.q_proj.bias"],
            k_w=t[p + "self_attn.k_proj.weight"],
            k_b=t[p + "self_attn.k_proj.bias"],
            v_w=t[p + "self_attn.v_proj.weight"],
            v_b=t[p + "self_attn.v_proj.bias"],
            o_w=t[p + "self_attn.out_proj.weight"],
            o_b=t[p + "self_attn.out_proj.bias"],
            attn_ln_w=t[p + "self_attn_layer_norm.weight"],
            attn_ln_b=t[p + "self_attn_layer_norm.bias"],
            fc1_w=t[p + "fc1.weight"],
            fc1_b=t[p + "fc1.bias"],
            fc2_w=t[p + "fc2.weight"],
            fc2_b=t[p + "fc2.bias"],
            ffn_ln_w=t[p + "final_layer_norm.weight"],
            ffn_ln_b=t[p + "final_layer_norm.bias"],
        )

    def to(self, device: torch.device | str, dtype: torch.dtype) -> OptWeights:
        """The same weights on ``device`` in ``dtype`` (no copy for those already there)."""
        moved = {n: w.to(device=device, dtype=dtype) for n, w in self.tensors.items()}
        return OptWeights(self.arch, moved)


def random_weights(
    arch: OptArchitecture,
    seed: int = 0,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> OptWeights:
    """Deterministic random weights for ``arch`` (the same seed, device and dtype: the same bits).

    Embeddings and biases are N(0, 0.02²); linear weights N(0, 4/fan_in); LayerNorm weights
    N(1, 0.2²) and biases N(0, 0.2²). Generated on ``device`` so that a large preset does not
    have to pass through host memory.
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in parameter_shapes(arch).items():
        if "layer_norm" in name:
            base, std = (1.0 if name.endswith(".weight") else 0.0), 0.2
        elif name.endswith(".weight") and "embed" not in name:
            base, std = 0.0, 2.0 / math.sqrt(shape[1])
        else:
            base, std = 0.0, 0.02
        values = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
        tensors[name] = (values * std + base).to(dtype)
    return OptWeights(arch, tensors)
