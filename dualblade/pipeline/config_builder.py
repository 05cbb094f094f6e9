"""A pipeline config for a model whose shape the caller knows, over the caller's other settings.

``dualblade generate``, the example service and ``DualBladeCache`` each run a model whose KV
geometry comes from the model itself (an OPT architecture, a transformers config), not from a
config file; the file, or the caller's mapping, only says where and how the bytes go. This is the
one place that writes such a shape and a workload into a config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dualblade.pipeline.config import PipelineConfig, Policy
from dualblade.pipeline.config_loader import config_from_mapping
from dualblade.pipeline.shapes import ModelShape


def config_for_model(
    base: PipelineConfig | Mapping[str, Any],
    shape: ModelShape,
    *,
    batch: int,
    prompt_len: int,
    max_new_tokens: int,
    policy: Policy | None = None,
    source: str = "config",
) -> PipelineConfig:
    """``base``'s settings (storage, memory, copy threads ...) with ``shape`` and this workload.

    The model section becomes the shape's explicit numbers (no preset, so nothing is re-derived)
    and the workload section ``batch``, ``prompt_len`` and ``max_new_tokens``, whatever ``base``
    said of either; ``policy``, when given, replaces ``base``'s. Environment overrides do not
    apply: what the caller passes is what runs.

    Raises:
        ConfigError: one paragraph naming every invalid field of ``source``.
    """
    data: dict[str, Any] = base.model_dump() if isinstance(base, PipelineConfig) else dict(base)
    data["model"] = {
        "num_layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "num_heads": shape.num_heads,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "dtype": shape.dtype,
    }
    data["workload"] = {
        "batch": batch,
        "prompt_len": prompt_len,
        "max_new_tokens": max_new_tokens,
    }
    if policy is not None:
        data["policy"] = policy
    return config_from_mapping(data, source=source, env={})
