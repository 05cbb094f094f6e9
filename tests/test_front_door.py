"""The package's front door: every name in __all__ resolves to the subpackage's own object."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import dualblade


def test_every_public_name_resolves_to_its_subpackage_object() -> None:
    from dualblade import (  # the README's first example
        KVContext,
        KVStore,
        PipelineConfig,
        load_config,
        open_store,
        open_store_blocking,
    )

    store = importlib.import_module("dualblade.store")
    pipeline = importlib.import_module("dualblade.pipeline")
    assert (open_store, open_store_blocking, KVStore, KVContext) == (
        store.open_store,
        store.open_store_blocking,
        store.KVStore,
        store.KVContext,
    )
    assert (load_config, PipelineConfig) == (pipeline.load_config, pipeline.PipelineConfig)
    for name in dualblade.__all__:
        assert getattr(dualblade, name) is not None
    assert issubclass(dualblade.LayerLostError, dualblade.DualbladeError)
    assert issubclass(dualblade.IOFailedError, dualblade.DualbladeError)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = dualblade.nope  # type: ignore[attr-defined]


def test_the_cli_does_not_load_torch_through_the_front_door() -> None:
    code = "import sys, dualblade.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_python_dash_m_runs_the_command_line_and_passes_its_exit_code() -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "dualblade", "--help"], capture_output=True, text=True
    )
    assert ok.returncode == 0
    assert ok.stdout.startswith("usage: dualblade ")
    bad = subprocess.run(
        [sys.executable, "-m", "dualblade", "plan", "/nonexistent/config.toml"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0
    assert "dualblade plan: error:" in bad.stderr
