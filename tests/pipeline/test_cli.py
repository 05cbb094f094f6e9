"""``dualblade plan`` and ``dualblade config``: output shapes, and errors as one paragraph."""

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dualblade.cli import main
from dualblade.pipeline import page_cache_order

ROOT = Path(__file__).resolve().parents[2]
PAPER = str(ROOT / "configs/opt-6.7b-paper.toml")


def test_plan_json(capsys):
    assert main(["plan", PAPER, "--memory-limit", "6GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    budget = data["budget"]
    n1 = budget["page_cache_bytes"] // data["placement"]["layer_kv_bytes"]
    page_cache = sorted(page_cache_order(32)[:n1])  # spread over the model (the default)
    assert data["groups"]["page_cache"] == page_cache
    assert data["groups"]["direct"] == sorted(set(range(32)) - set(page_cache))
    assert budget["limit_bytes"] == 6 << 30
    extents = data["extents"]
    assert extents[0]["kpu"] == f"L{data['groups']['direct'][0]}.K"
    for before, after in itertools.pairwise(extents):
        assert after["lba_start"] == before["lba_start"] + before["n_blocks"]


def test_plan_table(capsys):
    assert main(["plan", PAPER, "--memory-limit", "6GiB"]) == 0
    out = capsys.readouterr().out
    assert "= page-cache budget B_pc" in out
    assert "groups (n1 = 20, page-cache layers spread)" in out
    assert "page cache    20 layers" in out
    assert "0, 2, 4, 6-8, 10, 12, 14-16, 18, 20, 22-24, 26, 28, 30-31" in out
    assert "1, 3, 5, 9, 11, 13, 17, 19, 21, 25, 27, 29" in out
    assert "L29.V" in out  # the last direct layer


def test_plan_table_leading_layers(tmp_path, capsys):
    """``page_cache_layers = "leading"``: the paper's literal Algorithm 1, layers 0..n1-1."""
    config = tmp_path / "leading.toml"
    leading = 'policy = "dual"\npage_cache_layers = "leading"'
    config.write_text(Path(PAPER).read_text().replace('policy = "dual"', leading))
    assert main(["plan", str(config), "--memory-limit", "6GiB"]) == 0
    out = capsys.readouterr().out
    assert "groups (n1 = 20, page-cache layers leading)" in out
    assert "0-19" in out
    assert "20-31" in out


def test_plan_with_discovered_memory(capsys):
    assert main(["plan", str(ROOT / "configs/default.toml"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # knob_x = 32 MiB, 6.4 MiB a layer: 5 layers, spread over the 12
    assert data["groups"]["page_cache"] == [0, 2, 4, 6, 8]


def test_config_check_and_schema(capsys):
    assert main(["config", "check", PAPER]) == 0
    assert "valid" in capsys.readouterr().out
    assert main(["config", "schema"]) == 0
    assert json.loads(capsys.readouterr().out)["title"] == "dualblade pipeline config"


@pytest.mark.parametrize("command", ["plan", "config check"])
def test_malformed_config_exit_2_one_paragraph(tmp_path, command):
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\npreset = "opt-6.7b"\n[workload]\nbatch = -1\nprompt_len = 8\n')
    result = subprocess.run(
        [sys.executable, "-m", "dualblade.cli", *command.split(), str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    stderr = result.stderr.strip()
    assert "Traceback" not in stderr
    assert len(stderr.splitlines()) == 1
    assert "workload.batch: Input should be greater than 0 (got -1)" in stderr
    assert "workload.max_new_tokens: required but missing" in stderr


def test_bad_memory_limit(capsys):
    assert main(["plan", PAPER, "--memory-limit", "six"]) == 2
    assert "'six' is not a size" in capsys.readouterr().err


def test_plan_into_a_closed_pipe_is_quiet():
    """`dualblade plan ... | head -c 1500` must not end in a BrokenPipeError traceback."""
    reader, writer = os.pipe()
    os.close(reader)  # the reader is gone before anything is written: every write gets EPIPE
    try:
        result = subprocess.run(
            [sys.executable, "-m", "dualblade.cli", "plan", PAPER, "--memory-limit", "6GiB"],
            stdout=writer,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    finally:
        os.close(writer)
    assert "Traceback" not in result.stderr
    assert result.returncode == 0


def test_plan_for_a_cuda_store(capsys):
    """``--device cuda`` budgets as a CUDA store does: at 4 GiB the paper's context does not fit,
    so one pinned image per copy thread (the second would cost page-cache layers) and the room
    for rows are reserved; at 16 GiB every layer fits with two images."""
    assert main(["plan", PAPER, "--memory-limit", "4GiB", "--json"]) == 0
    host = json.loads(capsys.readouterr().out)["budget"]
    assert main(["plan", PAPER, "--memory-limit", "4GiB", "--device", "cuda", "--json"]) == 0
    cuda = json.loads(capsys.readouterr().out)["budget"]
    assert (host["pin_images"], cuda["pin_images"]) == (1, 1)
    assert host["row_room_bytes"] == 0 < cuda["row_room_bytes"]
    rows = cuda["copy_threads"] * cuda["row_room_bytes"]
    assert cuda["page_cache_bytes"] == host["page_cache_bytes"] - rows
    assert main(["plan", PAPER, "--memory-limit", "16GiB", "--device", "cuda", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["budget"]["pin_images"] == 2
    assert data["groups"]["direct"] == []
