"""The engine's own trace track: the prefill and each decode step, with every layer's compute and
every wait for a read or for the writes behind, in order, inside them."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dualblade.cli import main
from dualblade.models.factory import random_prompts
from dualblade.models.kv import MemoryKV
from dualblade.models.opt import ENGINE_TRACK, OptModel
from dualblade.telemetry import Tracer

pytestmark = pytest.mark.anyio

LAYERS = 4  # opt-tiny


def engine_slices(document: dict[str, Any], track: str = ENGINE_TRACK) -> list[dict[str, Any]]:
    events = document["traceEvents"]
    tids = {
        e["tid"]
        for e in events
        if e.get("ph") == "M" and e["name"] == "thread_name" and e["args"]["name"] == track
    }
    return sorted(
        (e for e in events if e.get("ph") == "X" and e["tid"] in tids), key=lambda e: e["ts"]
    )


def inside(outer: dict[str, Any], slices: list[dict[str, Any]]) -> list[str]:
    """The names of ``slices`` that lie within ``outer``, in time order."""
    end = outer["ts"] + outer["dur"]
    return [
        s["name"]
        for s in slices
        if s is not outer and outer["ts"] <= s["ts"] and s["ts"] + s["dur"] <= end
    ]


async def test_every_step_holds_its_layers_waits_and_computes_in_order(
    opt_tiny: OptModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    tracer = Tracer()
    monkeypatch.setattr(opt_tiny, "tracer", tracer)
    kv = MemoryKV(layers=LAYERS, batch=2, max_len=20, width=64, dtype=torch.float16)
    await opt_tiny.generate(random_prompts(2, 16, 1024, seed=3), 4, kv)

    slices = engine_slices(tracer.document())
    steps = [s for s in slices if s["name"].startswith("decode step")]
    assert [s["name"] for s in steps] == ["decode step 1", "decode step 2", "decode step 3"]
    for step in steps:
        layers = [x for i in range(LAYERS) for x in (f"read L{i}", f"L{i}")]
        assert inside(step, slices) == ["embed", *layers, "logits"]

    (prefill,) = [s for s in slices if s["name"] == "prefill"]
    assert prefill["args"]["rows"] == 16
    within = inside(prefill, slices)
    assert within[0] == "embed"
    assert within[-1] == "logits"
    computes = [name for name in within if name.startswith("L")]
    assert computes == [f"L{i}" for i in range(LAYERS)]
    assert within.count("writes behind") == LAYERS  # each layer's write waited for its turn
    # the steps and the prefill do not overlap: one track, properly nested
    top = [prefill, *steps]
    assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in itertools.pairwise(top))


async def test_a_model_without_a_tracer_records_nothing(opt_tiny: OptModel) -> None:
    kv = MemoryKV(layers=LAYERS, batch=1, max_len=10, width=64, dtype=torch.float16)
    await opt_tiny.generate(random_prompts(1, 8, 1024, seed=1), 2, kv)
    assert not opt_tiny.tracer.enabled
    assert opt_tiny.tracer.document()["traceEvents"] == []


def test_generate_writes_the_engine_and_the_store_into_one_trace(
    capsys: pytest.CaptureFixture[str], opt_pipeline_toml: Path, tmp_path: Path
) -> None:
    trace = tmp_path / "traces" / "generate.json"
    argv = ["generate", "--preset", "opt-tiny", "--batch", "2", "--prompt-len", "16"]
    argv += ["--gen-len", "3", "--policy", "dual", "--config", str(opt_pipeline_toml)]
    assert main([*argv, "--device", "cpu", "--json", "--trace", str(trace)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["trace"] == str(trace)
    document = json.loads(trace.read_text())
    names = {
        e["args"]["name"]
        for e in document["traceEvents"]
        if e.get("ph") == "M" and e["name"] == "thread_name"
    }
    assert {ENGINE_TRACK, "binder", "copy-thread-0"} <= names
    steps = [s for s in engine_slices(document) if s["name"].startswith("decode step")]
    assert [s["name"] for s in steps] == ["decode step 1", "decode step 2"]
    # one clock: the copy threads' loads of each step lie inside that step's slice
    loads = [
        s
        for track in sorted(names)
        if track.startswith("copy-thread")
        for s in engine_slices(document, track)
        if s["name"].startswith("load")
    ]
    for step in steps:
        end = step["ts"] + step["dur"]
        assert any(step["ts"] <= s["ts"] and s["ts"] + s["dur"] <= end for s in loads)


def test_a_trace_path_that_is_a_folder_is_refused_before_the_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["generate", "--preset", "opt-tiny", "--device", "cpu", "--trace", str(tmp_path)]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "is a folder" in err
    assert "Traceback" not in err
