"""``dualblade lmcache-bench``'s checks of its arguments (the run itself needs root and minutes:
docs/lmcache.md)."""

from __future__ import annotations

import pytest

from dualblade.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--adapters", "dualblade,nfs"], "--adapters takes a list of"),
        (["--adapters", "raw-block"], "need --block DEVICE"),
        (["--rounds", "0"], "must be >= 1"),
        (["--memory-limit", "plenty"], "--memory-limit: 'plenty' is not a size"),
        (["--capacity", "lots"], "--capacity: 'lots' is not a size"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(
    argv: list[str], message: str, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["lmcache-bench", "--dir", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing was made


def test_help_names_the_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["lmcache-bench", "--help"])
    assert "memory cgroup" in capsys.readouterr().out


def test_the_ratios_take_ours_on_the_block_device_when_it_ran_alone() -> None:
    from dualblade.commands._lmcache_report import lmcache_ratios

    results = [
        {"adapter": "dualblade-block", "load_mbps": 3000.0},
        {"adapter": "fs-odirect", "load_mbps": 2000.0},
        {"adapter": "fs", "load_mbps": 1500.0},
        {"adapter": "dualblade-direct", "load_mbps": 1800.0},
    ]
    ratios = lmcache_ratios(results, {"mbps": 2000.0})
    assert ratios == {"dualblade_vs_fs_best": 1.5, "direct_vs_fio": 0.9}
    assert lmcache_ratios([{"adapter": "fs", "load_mbps": None}], None) == {
        "dualblade_vs_fs_best": None,
        "direct_vs_fio": None,
    }
