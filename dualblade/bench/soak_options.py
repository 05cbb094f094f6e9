"""What a soak runs: its options, and the small store it runs them on.

The shape is chosen so that faults land mid-request: small chunks (a KPU transfer is several of
them) and rows padded to whole blocks, with half of the layers on each path under ``dual``.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
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
        kill_restart: run the store in child processes, each killed (SIGKILL) at a random
            moment and followed by a new one on the same folder, which must reclaim all the
            dead one left (:mod:`.soak_restart`).
        restart_after_s: a child is killed this many seconds (uniform in the range) after its
            store started.
        full_disk: put the scratch folder on a small tmpfs (root only), so contexts meet a
            full disk for real at claims, writes and page-cache files (:mod:`.soak_disk`).
        pressure: shrink and grow the page-cache budget while contexts decode, with the
            store's live re-planning on (:mod:`.soak_pressure`); needs a fault rate of 0.
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
    kill_restart: bool = False
    restart_after_s: tuple[float, float] = (1.0, 4.0)
    full_disk: bool = False
    pressure: bool = False

    def check(self) -> None:
        """Raises ConfigError for values that cannot run (or modes this machine cannot run)."""
        if self.pressure and self.fault_rate:
            raise ConfigError(
                "--pressure runs without injected faults: a fault on a layer move is the "
                "store's, not a context operation's, and the soak attributes every fault to an "
                "operation; give --fault-rate 0"
            )
        if self.full_disk and os.geteuid() != 0:
            raise ConfigError(
                "--full-disk mounts a small tmpfs for the scratch folder, which needs root; "
                "run it with sudo"
            )
        low, high = self.restart_after_s
        if not 0 < low <= high:
            raise ConfigError(f"--restart-after needs 0 < MIN_S <= MAX_S, got {low} {high}")
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
    # Half of the layers on each path under ``dual`` (and evicted under ``cache-policy``), for
    # every context at once: the budget is the store's, shared by its live contexts.
    layers = layer_page_cache_bytes(config)
    knob = sum(layers[: len(layers) // 2]) * options.contexts
    data["memory"] = {"page_cache_budget": max(64 << 20, knob), "knob_x": knob}
    return config_from_mapping(data, env={})


def options_to_json(options: SoakOptions) -> dict[str, Any]:
    """The options as JSON-ready data (to hand them to a child process)."""
    data = asdict(options)
    data["workdir"] = None if options.workdir is None else str(options.workdir)
    return data


def options_from_json(data: dict[str, Any]) -> SoakOptions:
    """The inverse of :func:`options_to_json`."""
    data = dict(data)
    data["workdir"] = None if data["workdir"] is None else Path(data["workdir"])
    data["restart_after_s"] = tuple(data["restart_after_s"])
    return SoakOptions(**data)
