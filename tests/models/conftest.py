"""Shared by the OPT engine tests: a pipeline config under the tmp dir, the opt-tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualblade.models.architecture import OptArchitecture
from dualblade.models.opt import OptModel
from dualblade.models.weights import random_weights

#: opt-tiny, batch 4, 64 + 8 tokens: one layer's K plus V in the page cache is 2 × 36 KiB, so
#: knob_x = 144 KiB puts two layers (0 and 2, spread over the model) on the page cache and 1 and
#: 3 on the direct path under dual, and makes cache-policy evict layers 1 and 3 after use: every
#: path carries traffic.
PIPELINE_TOML = """
policy = "dual"
copy_threads = 2
queue_depth = 8
max_chunk = "64KiB"

[model]
preset = "opt-125m"

[workload]
batch = 1
prompt_len = 1
max_new_tokens = 1

[memory]
page_cache_budget = "8MiB"
knob_x = "144KiB"

[storage]
page_cache_dir = "{root}/pc"

[storage.direct]
kind = "file"
path = "{root}/direct.kv"
"""


@pytest.fixture
def opt_pipeline_toml(tmp_path: Path) -> Path:
    """A pipeline config file whose storage lies under ``tmp_path``."""
    path = tmp_path / "pipeline.toml"
    path.write_text(PIPELINE_TOML.format(root=tmp_path))
    return path


@pytest.fixture(scope="session")
def opt_tiny() -> OptModel:
    """opt-tiny with the random weights of seed 0 (what ``generate --preset opt-tiny`` runs)."""
    return OptModel(random_weights(OptArchitecture.from_preset("opt-tiny"), 0))
