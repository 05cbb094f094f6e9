"""``dualblade doctor`` and ``dualblade iobench`` end to end, through the real CLI entry point."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dualblade.cli import main


def test_doctor_json_reports_io_uring(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["io_uring"]["available"] in (True, False)
    if report["io_uring"]["available"]:
        assert report["io_uring"]["opcodes"]["READ"] is True
    assert report["targets"]["file"]["usable"] is True


def test_doctor_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    assert "io_uring" in capsys.readouterr().out


def test_iobench_small_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "bench.dat"
    code = main(
        [
            "iobench",
            "--target",
            str(target),
            "--size",
            "8MiB",
            "--block-size",
            "128KiB",
            "--queue-depth",
            "4",
            "--runs",
            "2",
            "--json",
        ]
    )
    assert code == 0
    document = json.loads(capsys.readouterr().out)
    direct = document["results"]["direct"]
    assert direct["write"]["runs"] == direct["read"]["runs"] == 2
    assert direct["read"]["median_bytes_per_s"] > 0
    # User CPU is sampled in scheduler ticks: 8 MiB of I/O may take less than one (0 then).
    assert document["cpu_us_per_chunk"] >= 0
    if shutil.which("fio"):
        assert set(document["direct_vs_fio"]) == {"read", "write"}
        assert document["fio_cpu_us_per_chunk"] is not None
    else:
        assert "direct_vs_fio" not in document
    assert target.stat().st_size == 8 << 20


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--block-size", "1000"], "multiple of 4096"),
        (["--size", "4KiB"], "at least one block"),
        (["--size", "lots"], "is not a size"),
        (["--runs", "0"], "at least 1"),
    ],
)
def test_iobench_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code = main(["iobench", "--target", str(tmp_path / "x.dat"), *args])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_pipebench_on_a_given_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "small.toml"
    config.write_text(
        f"""
policy = "dual"
copy_threads = 2
[model]
num_layers = 3
hidden_size = 512
num_heads = 8
dtype = "float16"
[workload]
batch = 4
prompt_len = 24
max_new_tokens = 2
[memory]
page_cache_budget = "1MiB"
[storage]
page_cache_dir = "{tmp_path}/pc"
[storage.direct]
kind = "block"
path = "/dev/does-not-exist"
extent_size = "64MiB"
lba_size = 512
"""
    )
    target = tmp_path / "fast.kv"
    args = ["pipebench", str(config), "--target", str(target), "--runs", "2", "--passes", "2"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["target"] == str(target)  # the config's block device was never opened
    assert report["bytes_per_pass"] == 3 * 2 * 26 * 4 * 512 * 2  # every layer's K and V
    assert len(report["pipeline_bytes_per_s"]) == len(report["raw_bytes_per_s"]) == 2
    assert report["pipeline_cpu_s_per_gb"] > 0
    assert report["raw_cpu_s_per_gb"] > 0
    assert report["ratio"] > 0
    if shutil.which("fio"):  # fio read the very extents the raw engine read, once per run
        assert len(report["fio_bytes_per_s"]) == 2
        assert report["raw_vs_fio"] > 0
    else:
        assert report["fio_note"].startswith("fio is not installed")
    assert main([*args[:-4], "--runs", "1", "--passes", "1", "--no-fio"]) == 0
    assert "fio not run: --no-fio" in capsys.readouterr().out


def test_pipebench_page_cache_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every layer in the page cache, resident, read through the pipeline and moved by plain
    threads (the machine's limit), both over the same bytes."""
    config = tmp_path / "small.toml"
    config.write_text(
        f"""
copy_threads = 2
[model]
num_layers = 3
hidden_size = 512
num_heads = 8
dtype = "float16"
[workload]
batch = 4
prompt_len = 24
max_new_tokens = 2
[storage]
page_cache_dir = "{tmp_path}/pc"
[storage.direct]
path = "{tmp_path}/direct.kv"
"""
    )
    args = ["pipebench", str(config), "--path", "page-cache", "--runs", "2", "--passes", "2"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["path"] == "page-cache"
    assert report["bytes_per_pass"] == 3 * 2 * 26 * 4 * 512 * 2  # every layer's K and V
    assert len(report["pipeline_bytes_per_s"]) == len(report["limit_bytes_per_s"]) == 2
    assert all(count & (count - 1) == 0 for count in report["limit_threads"])  # powers of 2
    assert report["resident_fraction"] == 1.0
    assert report["ratio"] > 0
    assert main([*args, "--target", str(tmp_path / "x")]) == 2
    assert "does not apply to --path page-cache" in capsys.readouterr().err
