"""What sizes the cache's store: the model's attention geometry, the caller's settings, and the
pipeline config built from both for one batch and KV dtype."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dualblade.models.hf_cache._transformers import PreTrainedConfig
from dualblade.models.hf_cache.errors import DualBladeCacheError
from dualblade.pipeline import (
    DType,
    ModelShape,
    PipelineConfig,
    Policy,
    StorageSection,
    config_for_model,
)
from dualblade.store import TORCH_DTYPES, dtype_name

# Layer kinds whose cache is a plain, growing K/V per token. Sliding and chunked layers are kept
# in full: their masks, built from get_mask_sizes' absolute positions, do the windowing.
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}


class Geometry:
    """The attention shape of a transformers decoder config: what sizes the store."""

    def __init__(self, config: PreTrainedConfig) -> None:
        text = config.get_text_config(decoder=True)
        if getattr(text, "is_encoder_decoder", False):
            raise DualBladeCacheError(
                "DualBladeCache offloads decoder-only models; encoder-decoder models keep a "
                "cross-attention cache it does not implement"
            )
        layer_types = getattr(text, "layer_types", None)
        unsupported = sorted(set(layer_types or []) - _ATTENTION_LAYER_TYPES)
        if unsupported:
            raise DualBladeCacheError(
                f"the model has layers of type {unsupported}; DualBladeCache stores per-token K "
                f"and V of attention layers only ({sorted(_ATTENTION_LAYER_TYPES)})"
            )
        self.name = str(getattr(text, "model_type", None) or "transformers model")
        self.num_layers = int(text.num_hidden_layers)
        self.num_heads = int(text.num_attention_heads)
        self.hidden_size = int(text.hidden_size)
        self.num_kv_heads = int(getattr(text, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(text, "head_dim", None) or self.hidden_size // self.num_heads)
        # transformers keeps the dtype as a torch.dtype, a name ("float16") or None.
        model_dtype = getattr(text, "dtype", None)
        if isinstance(model_dtype, str):
            model_dtype = getattr(torch, model_dtype, None)
        self.dtype = model_dtype if isinstance(model_dtype, torch.dtype) else None

    def shape(self, dtype: DType) -> ModelShape:
        """The pipeline's model shape of this geometry with KV in ``dtype``.

        Raises:
            ConfigError: heads that do not group (``num_heads`` not a multiple of the KV heads).
        """
        return ModelShape(
            self.name,
            self.num_layers,
            self.hidden_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            dtype,
        )


def held_dtype(dtype: torch.dtype) -> DType | None:
    """The store's name of ``dtype``; None for a dtype no store holds."""
    return dtype_name(dtype) if dtype in TORCH_DTYPES.values() else None


def store_config(
    geometry: Geometry,
    overrides: Mapping[str, Any],
    max_cache_len: int,
    batch_size: int,
    dtype: torch.dtype,
) -> PipelineConfig:
    """The store's config for this batch and dtype: the caller's settings, the model's shape.

    Raises:
        DualBladeCacheError: the dtype is not one the store holds.
        ConfigError: an override is not a valid pipeline config.
    """
    name = held_dtype(dtype)
    if name is None:
        raise DualBladeCacheError(
            f"the model's KV dtype is {dtype}; the store holds "
            f"{', '.join(TORCH_DTYPES)}: load the model in one of them"
        )
    # max_len = prompt_len + max_new_tokens is all the store uses of the workload.
    return config_for_model(
        overrides,
        geometry.shape(name),
        batch=batch_size,
        prompt_len=max_cache_len,
        max_new_tokens=0,
        source="DualBladeCache",
    )


def caller_overrides(
    pipeline: Mapping[str, Any] | PipelineConfig | None,
    policy: Policy | None,
    storage: Mapping[str, Any] | StorageSection | None,
) -> dict[str, Any]:
    """The caller's pipeline settings as one mapping; model and workload are the cache's own.

    Raises:
        DualBladeCacheError: ``pipeline`` sets the model or the workload.
    """
    if isinstance(pipeline, PipelineConfig):
        data: dict[str, Any] = pipeline.model_dump()
        del data["model"], data["workload"]
    else:
        data = dict(pipeline or {})
        clash = sorted({"model", "workload"} & set(data))
        if clash:
            raise DualBladeCacheError(
                f"pipeline sets {clash}: DualBladeCache takes the model shape from the model's "
                "config and the workload from batch_size and max_cache_len"
            )
    if policy is not None:
        data["policy"] = policy
    if storage is not None:
        data["storage"] = (
            storage.model_dump() if isinstance(storage, StorageSection) else dict(storage)
        )
    return data
