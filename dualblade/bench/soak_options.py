"""What a soak runs: its options, and the small store it runs them on.

The shape is chosen so that faults land mid-request: small chunks (a KPU transfer is several of
them) and rows padded to whole blocks, with half of the layers on each path under ``dual``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dualblade.errors import ConfigError
from dualblade.pipeline import PipelineConfig, config_from_mapping, layer_page_cache_bytes

#: A small GQA shape whose rows (3 × 4 × 64 bfloat16 = 1.5 KiB) are padded to 4 KiB blocks.
SOAK_MODEL: dict[str, Any] = {
    "num_layers": 4,
    "hidden_size": 512,
    "num_heads": 8,
    "num_kv_heads": 4,
    "dtype": "bfloat16",
}
SOAK_BATCH = 3
PROMPT_LEN = 48
NEW_TOKENS = 16
#: Small chunks, so a KPU transfer is several chunks and faults hit the middle of requests.
MAX_CHUNK = 64 << 10


@dataclass(frozen=True)
class SoakOptions:
    """What to run.

    Args:
        seconds: how long workers start new operations.
        contexts: concurrent workers, each with one open context at a time.
        seed: seeds data, operations, cancellations and faults.
        fault_rate: share of direct-path chunks that get a fault.
        cancel_rate: share of operations run under a random short deadline.
        policy: the store's placement policy (faults hit its direct path).
        workdir: where the scratch folder goes (default: dualblade's cache folder).
        sample_s: seconds between memory samples (default: a twelfth of the run, at most 5).
        max_rss_growth: the run fails above this growth (checked for runs of two minutes or more).
    """

    seconds: float
    contexts: int
    seed: int = 0
    fault_rate: float = 0.02
    cancel_rate: float = 0.1
    policy: str = "dual"
    workdir: Path | None = None
    sample_s: float | None = None
    max_rss_growth: float = 0.05

    def check(self) -> None:
        """Raises ConfigError for values that cannot run."""
        if not self.seconds > 0 or not math.isfinite(self.seconds):
            raise ConfigError(f"the soak needs a positive duration, got {self.seconds} s")
        if not 1 <= self.contexts <= 1024:
            raise ConfigError(f"--contexts must be in 1..1024, got {self.contexts}")
        if not 0 <= self.fault_rate <= 1:
            raise ConfigError(f"--fault-rate must be in [0, 1], got {self.fault_rate}")
        if not 0 <= self.cancel_rate <= 1:
            raise ConfigError(f"--cancel-rate must be in [0, 1], got {self.cancel_rate}")


def soak_config(options: SoakOptions, folder: Path) -> PipelineConfig:
    """The store the soak runs: small GQA shape, direct file and page-cache files in ``folder``."""
    data: dict[str, Any] = {
        "model": SOAK_MODEL,
        "workload": {
            "batch": SOAK_BATCH,
            "prompt_len": PROMPT_LEN,
            "max_new_tokens": NEW_TOKENS,
        },
        "memory": {"page_cache_budget": "64MiB"},
        "storage": {"direct": {"path": str(folder / "direct.kv")}, "page_cache_dir": str(folder)},
        "policy": options.policy,
        "max_chunk": MAX_CHUNK,
    }
    config = config_from_mapping(data, env={})
    # Half of the layers on each path under ``dual`` (and evicted under ``cache-policy``).
    layers = layer_page_cache_bytes(config)
    half = sum(layers[: len(layers) // 2])
    data["memory"] = {"page_cache_budget": "64MiB", "knob_x": half}
    return config_from_mapping(data, env={})
