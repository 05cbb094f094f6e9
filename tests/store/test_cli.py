"""``dualblade run``: the main job end to end, with --json and --trace."""

from __future__ import annotations

import json

import pytest

from dualblade.cli import main

CONFIG = """
policy = "dual"
strategy = "auto"
copy_threads = 2
queue_depth = 8

[model]
num_layers = 4
hidden_size = 256
num_heads = 4
dtype = "float16"

[workload]
batch = 3
prompt_len = 32
max_new_tokens = 4

[memory]
page_cache_budget = "2MiB"
knob_x = "240KiB"  # two layers of 112 KiB on the page-cache path

[storage]
page_cache_dir = "{tmp}/pc"

[storage.direct]
path = "{tmp}/direct.kv"
"""


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = tmp_path / "run.toml"
    path.write_text(CONFIG.format(tmp=tmp_path))
    return path


def test_run_json_and_trace(config_file, tmp_path, capsys):
    trace = tmp_path / "out" / "trace.json"
    assert main(["run", str(config_file), "--json", "--trace", str(trace)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prefill_s"] > 0
    assert report["decode_s"] > 0
    assert report["strategy"] in {"intra", "cross"}
    assert report["verified_bytes"] > 0
    assert len(report["decode_step_s"]) == 4
    assert report["strategies_by_step"][1:3] == ["intra", "cross"]
    assert report["strategies_by_step"][3] == report["strategy"]
    assert report["path_split"]["page_cache_layers"]
    assert report["path_split"]["direct_layers"]
    assert report["trace"] == str(trace)
    document = json.loads(trace.read_text())
    names = [
        e["args"]["name"]
        for e in document["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    ]
    tids = {e["tid"] for e in document["traceEvents"] if e["ph"] != "M"}
    named = {
        e["tid"]: e["args"]["name"]
        for e in document["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    for kind in ["budgeter", "binder", "copy-thread-", "gpu-dma", "strategy-probe"]:
        assert any(n.startswith(kind) for n in names), f"no {kind} track"
        assert any(named.get(t, "").startswith(kind) for t in tids), f"no {kind} events"
    assert not (tmp_path / "xdg").exists() or not any((tmp_path / "xdg").rglob("*.kv"))


def test_run_table(config_file, capsys):
    assert main(["run", str(config_file), "--policy", "direct", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "direct" in out
    assert "strategy (locked)" in out


def test_run_error_is_one_paragraph(config_file, capsys):
    assert main(["run", str(config_file), "--steps", "100"]) == 1
    err = capsys.readouterr().err
    assert "dualblade run: error: 100 decode steps exceed workload.max_new_tokens (4)" in err
    assert "Traceback" not in err
