"""Small pipeline configs for store tests, all under the test's tmp dir."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

from dualblade.pipeline import PipelineConfig, config_from_mapping
from dualblade.store import torch_dtype

POLICIES = ["dual", "direct", "page-cache", "cache-policy", "baseline"]

#: Tiny shapes. "aligned": 4 × 512 halfs = 4096-byte rows (no padding). "odd-gqa": batch 3,
#: 2 KV heads of 32 (8 query heads): 384-byte rows padded to 4096.
SHAPES: dict[str, dict[str, Any]] = {
    "aligned": {
        "model": {"num_layers": 4, "hidden_size": 512, "num_heads": 8, "dtype": "float16"},
        "batch": 4,
    },
    "odd-gqa": {
        "model": {
            "num_layers": 4,
            "hidden_size": 256,
            "num_heads": 8,
            "num_kv_heads": 2,
            "dtype": "bfloat16",
        },
        "batch": 3,
    },
}


MakeConfig = Callable[..., PipelineConfig]


@pytest.fixture
def make_config(tmp_path: Path) -> MakeConfig:
    """``make_config(policy, shape="odd-gqa", prompt_len=16, max_new_tokens=4, **top_level)``.

    The page-cache budget is fixed (no polling) and ``knob_x`` puts two of the four layers on
    the page-cache path under ``dual`` (both paths carry traffic: layers 0 and 2, spread over
    the model by ``page_cache_order``) and makes ``cache-policy`` evict layers 1 and 3.
    """

    def make(
        policy: str = "dual",
        shape: str = "odd-gqa",
        *,
        prompt_len: int = 16,
        max_new_tokens: int = 4,
        model: dict[str, Any] | None = None,
        batch: int | None = None,
        direct: dict[str, Any] | None = None,
        memory: dict[str, Any] | None = None,
        **top: Any,
    ) -> PipelineConfig:
        spec = SHAPES[shape]
        data: dict[str, Any] = {
            "model": model or spec["model"],
            "workload": {
                "batch": batch or spec["batch"],
                "prompt_len": prompt_len,
                "max_new_tokens": max_new_tokens,
            },
            "memory": memory or {"page_cache_budget": "2MiB", "knob_x": "2MiB"},
            "storage": {
                "direct": {"path": str(tmp_path / "direct.kv"), **(direct or {})},
                "page_cache_dir": str(tmp_path / "pc"),
            },
            "policy": policy,
            **top,
        }
        config = config_from_mapping(data, env={})
        if policy in ("dual", "cache-policy") and memory is None:
            # knob_x = two layers: layers 0 and 2 cached, 1 and 3 direct (dual) or evicted
            # (cache-policy): spread over the model (page_cache_order).
            from dualblade.pipeline.planner import layer_page_cache_bytes

            two_layers = sum(layer_page_cache_bytes(config)[:2])
            data["memory"] = {"page_cache_budget": "2MiB", "knob_x": two_layers}
            config = config_from_mapping(data, env={})
        return config

    return make


def random_kv(config: PipelineConfig, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct K and V of ``rows`` rows for ``config``'s shape (seeded)."""
    shape = config.shape()
    generator = torch.Generator().manual_seed(seed)
    size = (rows, config.workload.batch, shape.kv_width)
    k = torch.randn(size, generator=generator).to(torch_dtype(shape.dtype))
    v = torch.randn(size, generator=generator).to(torch_dtype(shape.dtype))
    return k, v


async def prefill_and_append(
    ctx: Any, config: PipelineConfig, layers: int = 4, prompt_len: int = 40
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Write ``prompt_len`` seeded rows to each of ``layers`` layers and append one more; the K
    and V each layer then holds (both write paths, so a read is checked against both)."""
    expected = {}
    for layer in range(layers):
        k, v = random_kv(config, prompt_len, seed=layer)
        await ctx.write(layer, k, v)
        row_k, row_v = random_kv(config, 1, seed=50 + layer)
        await ctx.append(layer, row_k, row_v)
        expected[layer] = (torch.cat([k, row_k]), torch.cat([v, row_v]))
    return expected


@pytest.fixture(autouse=True)
def _fresh_structlog() -> Iterator[None]:
    """Undo the CLI's ``structlog.configure`` (it binds the test's captured stderr)."""
    yield
    structlog.reset_defaults()


MountTmpfs = Callable[[str], Path]


@pytest.fixture
def mount_tmpfs(tmp_path: Path) -> Iterator[MountTmpfs]:
    """``mount_tmpfs("1m")``: a tmpfs of that size under the test's tmp dir (root only; a small
    file system that fills up for real), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    with contextlib.ExitStack() as stack:

        def mount(size: str) -> Path:
            mount_point = tmp_path / f"tmpfs-{size}"
            mount_point.mkdir()
            result = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
                capture_output=True,
                text=True,
                check=False,
            )
            if result.returncode != 0:
                pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
            stack.callback(shutil.rmtree, mount_point, ignore_errors=True)
            stack.callback(subprocess.run, ["umount", "-l", str(mount_point)], check=False)
            return mount_point

        yield mount
