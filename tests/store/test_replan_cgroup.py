"""Live re-planning follows the budgeter's readings of a real memory cgroup (root only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dualblade.bench.cgroups import can_create_memory_cgroups, create_memory_cgroup

from .conftest import MakeConfig

CHILD = Path(__file__).with_name("_replan_child.py")
LAYER = 32 << 20  # rows of 4 KiB, batch 4: 4096 rows make a 16 MiB KPU, a 32 MiB layer


def test_a_lowered_cgroup_limit_demotes_live_layers(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    reason = can_create_memory_cgroups()
    if reason is not None:
        pytest.skip(f"needs a memory cgroup of its own: {reason}")
    config = make_config(
        "dual",
        "aligned",
        prompt_len=4092,
        max_new_tokens=4,
        memory={"safety_margin": "16MiB", "safety_fraction": 0.0},
    )
    config_path = tmp_path / "config.json"
    config_path.write_text(config.model_dump_json())
    report, go = tmp_path / "report.jsonl", tmp_path / "go"
    limit = 2 << 30
    group = create_memory_cgroup(f"dualblade-test-replan-{tmp_path.name}", limit)
    try:
        child = subprocess.Popen(
            [
                sys.executable,
                str(CHILD),
                str(config_path),
                str(group.path / "cgroup.procs"),
                str(report),
                str(go),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            first = None
            for _ in range(1200):
                if report.exists() and report.read_text().strip():
                    first = json.loads(report.read_text().splitlines()[0])
                    break
                if child.poll() is not None:
                    break
                subprocess.run(["sleep", "0.05"], check=True)
            assert first is not None, child.communicate(timeout=30)
            assert first["resident_layers"] == 4  # the whole context fits at first
            # Lower the limit so that the budget falls to about two layers.
            # Lower the limit to what the child holds outside the page cache, the safety
            # margin and about two layers: the budget the budgeter reads next falls to two.
            stat = group.stat()
            held = stat.get("rss", 0) + stat.get("shmem", 0)
            group.set_limit(held + (16 << 20) + 2 * LAYER + LAYER // 2)
            go.write_text("lowered")
            _out, err = child.communicate(timeout=120)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        assert child.returncode == 0, err[-3000:]
        after = json.loads(report.read_text().splitlines()[1])
    finally:
        group.remove()
    assert after["exact"] is True
    assert after["demotions"] >= 1
    assert after["failed_moves"] == 0
    assert after["resident_layers"] < 4
    assert after["placed"] <= after["budget"]
