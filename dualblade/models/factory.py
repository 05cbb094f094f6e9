"""From what a user names — a preset or a checkpoint, a policy, a batch — to a model, the
pipeline config that sizes its KV cache, and the KV provider it runs against.

``dualblade generate`` and the example service both go through here, so a request served over
HTTP and one run from the command line get the same model, the same prompts and the same store.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Literal, cast, get_args

import torch

from dualblade.errors import ConfigError
from dualblade.models.architecture import OptArchitecture
from dualblade.models.checkpoint import load_checkpoint
from dualblade.models.kv import KVProvider, MemoryKV
from dualblade.models.opt import OptModel
from dualblade.models.weights import random_weights
from dualblade.pipeline import PipelineConfig, config_for_model
from dualblade.pipeline import Policy as StorePolicy
from dualblade.store import TORCH_DTYPES, open_store, torch_dtype
from dualblade.telemetry import NULL_TRACER, Tracer

#: The store's policies, and ``memory``: the KV cache in RAM, the reference.
GeneratePolicy = Literal["dual", "direct", "page-cache", "cache-policy", "baseline", "memory"]
POLICIES: tuple[str, ...] = get_args(GeneratePolicy)
assert set(get_args(StorePolicy)) < set(POLICIES)


def compute_dtype(name: str) -> torch.dtype:
    """The torch dtype of ``float32``, ``float16`` or ``bfloat16``.

    Raises:
        ConfigError: any other name.
    """
    if name not in TORCH_DTYPES:
        raise ConfigError(f"compute dtype must be one of {', '.join(TORCH_DTYPES)}, got {name!r}")
    return torch_dtype(name)


def build_model(
    *,
    preset: str | None = None,
    model_path: str | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> OptModel:
    """An OPT model: a checkpoint when ``model_path`` is given (``preset`` then only supplies the
    architecture of a bare safetensors file), else ``preset``'s shape with random weights from
    ``seed``.

    Raises:
        ConfigError: neither given, an unknown or non-OPT preset, or a bad checkpoint.
    """
    if model_path is not None:
        arch = OptArchitecture.from_preset(preset) if preset is not None else None
        weights = load_checkpoint(model_path, arch=arch, device=device, dtype=dtype)
    elif preset is not None:
        weights = random_weights(
            OptArchitecture.from_preset(preset), seed, device=device, dtype=dtype
        )
    else:
        raise ConfigError("name a model: a preset (--preset) or a checkpoint path (--model)")
    return OptModel(weights, device=device, compute_dtype=dtype)


def store_config(
    base: PipelineConfig,
    arch: OptArchitecture,
    *,
    batch: int,
    prompt_len: int,
    gen_len: int,
    policy: str,
) -> PipelineConfig:
    """``base`` (storage, memory, copy threads ...) with the model's KV shape and this workload.

    Raises:
        ConfigError: an unknown policy, or values the pipeline config refuses.
    """
    if policy not in POLICIES:
        raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    store_policy = None if policy == "memory" else cast(StorePolicy, policy)
    return config_for_model(
        base,
        arch.shape(),
        batch=batch,
        prompt_len=prompt_len,
        max_new_tokens=gen_len,
        policy=store_policy,
        source=f"{arch.name} workload",
    )


@contextlib.asynccontextmanager
async def open_kv(
    config: PipelineConfig,
    policy: str,
    *,
    device: torch.device | str | None = None,
    memory_limit: int | None = None,
    tracer: Tracer = NULL_TRACER,
) -> AsyncIterator[KVProvider]:
    """The KV provider for ``policy``: a running :class:`KVStore`, or :class:`MemoryKV`.

    The store is started here and stopped when the block exits; its contexts are the requests.
    ``tracer`` receives the store's actors' trace events (the memory policy has none).
    """
    if policy == "memory":
        shape, workload = config.shape(), config.workload
        yield MemoryKV(
            layers=shape.num_layers,
            batch=workload.batch,
            max_len=workload.max_len,
            width=shape.kv_width,
            dtype=torch_dtype(shape.dtype),
            device=device or "cpu",
        )
        return
    async with open_store(config, device=device, memory_limit=memory_limit, tracer=tracer) as store:
        yield store


def random_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """``[batch, prompt_len]`` token ids drawn from ``seed``: a reproducible prompt batch.

    Raises:
        ConfigError: a batch or length below 1.
    """
    if batch < 1 or prompt_len < 1:
        raise ConfigError(f"batch and prompt length must be at least 1 (got {batch}, {prompt_len})")
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, prompt_len), generator=generator)
