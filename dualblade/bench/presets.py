"""Named sweeps for ``dualblade bench --preset``: a pipeline shape, limits, policies, steps.

- ``quick``: runs here in about 17 minutes. A 32-layer, 1024-wide fp16 model at batch 16
  and 1024 rows gives a 2 GiB KV working set, 2.7 times the smallest limit; every limit stays
  below the working set plus the process's own memory, so the page cache can never hold it all
  and the baseline's LRU has to choose. Three repeats, reported as medians: this VM's disk moves
  10-25 % from one second to the next, and one run per cell put a decode on either side of its
  floor (the baseline at 0.75 GiB: 0.92 to 1.36 of it in seven runs) and compared policies run
  a minute apart, on a disk whose speed had moved between them (docs/bench.md). ``--repeats 1``
  still runs it once, in about five minutes.
- ``paper``: the paper's setup — OPT-6.7B, batch 32, 512 prompt + 32 new tokens (8.6 GB of KV),
  host memory limits 2–11 GiB.
- ``long-context``: few sequences with long prompts and few new tokens, like the paper's
  data-cleaning tasks, at a 4 GiB limit.

``safety_margin`` leaves room for what a decode step itself allocates (the K and V tensors of the
layers in flight, two per copy thread), so the budgeted page-cache layers are not reclaimed to make
room for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dualblade.errors import ConfigError

GiB = 1 << 30
MiB = 1 << 20

ALL_POLICIES: tuple[str, ...] = ("baseline", "cache-policy", "direct", "dual")


@dataclass(frozen=True)
class BenchPreset:
    """What one sweep runs: pipeline overrides, the memory limits, the policies, the steps."""

    name: str
    description: str
    pipeline: dict[str, Any]
    limits: tuple[int, ...]
    policies: tuple[str, ...] = ALL_POLICIES
    decode_steps: int | None = None
    repeats: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


PRESETS: dict[str, BenchPreset] = {
    preset.name: preset
    for preset in (
        BenchPreset(
            name="quick",
            description="2 GiB of KV under 0.75–2 GiB limits, 3 repeats; about 17 minutes here",
            pipeline={
                "model": {
                    "num_layers": 32,
                    "hidden_size": 1024,
                    "num_heads": 16,
                    "dtype": "float16",
                },
                "workload": {"batch": 16, "prompt_len": 1019, "max_new_tokens": 5},
                "copy_threads": 2,
                "queue_depth": 32,
                "max_chunk": "1MiB",
                "memory": {"limit": "auto", "safety_margin": "256MiB"},
            },
            # 512 MiB does not fit the process itself (torch, the data, pinned and read buffers:
            # the OOM killer ended every policy there), so the smallest limit is 768 MiB.
            limits=(768 * MiB, 1088 * MiB, 1408 * MiB, 1728 * MiB, 2048 * MiB),
            repeats=3,
        ),
        BenchPreset(
            name="paper",
            description="OPT-6.7B, batch 32, 512 + 32 tokens, limits 2–11 GiB (hours here)",
            pipeline={
                "model": {"preset": "opt-6.7b"},
                "workload": {"batch": 32, "prompt_len": 512, "max_new_tokens": 32},
                "copy_threads": 4,
                "queue_depth": 32,
                "max_chunk": "1MiB",
                "memory": {"limit": "auto", "safety_margin": "1GiB"},
            },
            limits=tuple(n * GiB for n in (2, 3, 4, 5, 6, 7, 8, 9, 10, 11)),
        ),
        BenchPreset(
            name="long-context",
            description="OPT-6.7B, batch 4, 4096-token prompts, 4 new tokens, 4 GiB limit",
            pipeline={
                "model": {"preset": "opt-6.7b"},
                "workload": {"batch": 4, "prompt_len": 4096, "max_new_tokens": 4},
                "copy_threads": 4,
                "queue_depth": 32,
                "max_chunk": "1MiB",
                "memory": {"limit": "auto", "safety_margin": "1GiB"},
            },
            limits=(4 * GiB,),
        ),
    )
}


def get_bench_preset(name: str) -> BenchPreset:
    """Look a sweep preset up.

    Raises:
        ConfigError: no such preset; the message lists those that exist.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown bench preset {name!r} (presets: {', '.join(PRESETS)})"
        ) from None
