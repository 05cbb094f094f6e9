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
    assert ratios == {"dualblade_vs_fs_best": 1.5, "direct_vs_fio": 0.9, "fio_is_a_bound": True}
    assert lmcache_ratios([{"adapter": "fs", "load_mbps": None}], None) == {
        "dualblade_vs_fs_best": None,
        "direct_vs_fio": None,
        "fio_is_a_bound": None,
    }


def test_the_table_shows_how_much_of_the_stored_set_our_budget_held(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dualblade.commands._lmcache_report import print_lmcache_table

    ours = {
        "adapter": "dualblade",
        "load_mbps": 3000.0,
        "verified": True,
        "cgroup_peak_bytes": 3 << 30,
        "dualblade": {"placed": {"direct": 1}, "ledger": {"budget_bytes": 1 << 30}},
    }
    fs = {"adapter": "fs", "load_mbps": 1500.0, "verified": True, "cgroup_peak_bytes": None}
    print_lmcache_table(
        {
            "setup": {"stored_bytes": 2 << 30},
            "adapters": [ours, fs],
            "fio_read": {"mbps": 1800.0},
            "ratios": {"dualblade_vs_fs_best": 2.0, "direct_vs_fio": None},
        }
    )
    out = capsys.readouterr().out
    assert "pc budget (of stored)" in out
    assert "1.00 GiB (50%)" in out
    assert "load vs fs adapter's best: 2.0" in out


def test_the_table_shows_fio_on_each_adapters_own_extents(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dualblade.commands._lmcache_report import lmcache_ratios, print_lmcache_table

    reference = {"mbps": 1500.0, "passes_mbps": [1500.0, 2100.0, 2200.0]}
    direct = {
        "adapter": "dualblade-direct",
        "load_mbps": 1350.0,
        "verified": True,
        "cgroup_peak_bytes": None,
        "fio_own_extents": reference,
    }
    ratios = lmcache_ratios([direct], reference)
    assert ratios["direct_vs_fio"] == 0.9  # against the first pass: data of the loads' age
    print_lmcache_table(
        {"setup": {}, "adapters": [direct], "fio_read": reference, "ratios": ratios}
    )
    out = capsys.readouterr().out
    assert "fio, dualblade-direct's extents" in out
    assert "fio was beaten" not in out
    assert lmcache_ratios([direct], {"error": "no fio"})["direct_vs_fio"] is None


def test_a_beaten_fio_read_is_called_no_bound(capsys: pytest.CaptureFixture[str]) -> None:
    from dualblade.commands._lmcache_report import lmcache_ratios, print_lmcache_table

    direct = {"adapter": "dualblade-direct", "load_mbps": 1331.0, "verified": True}
    direct["cgroup_peak_bytes"] = None
    reference = {"mbps": 880.1, "passes_mbps": [880.1, 528.0, 877.6]}
    ratios = lmcache_ratios([direct], reference)
    assert ratios["direct_vs_fio"] == 1.51
    assert ratios["fio_is_a_bound"] is False
    print_lmcache_table(
        {"setup": {}, "adapters": [direct], "fio_read": reference, "ratios": ratios}
    )
    assert "fio was beaten: no bound this run" in capsys.readouterr().out


@pytest.mark.parametrize("no_fio", [False, True])
def test_our_adapters_read_their_own_extents_unless_told_not_to(
    tmp_path, monkeypatch: pytest.MonkeyPatch, no_fio: bool
) -> None:
    import argparse

    from dualblade.commands import lmcache_bench

    monkeypatch.setattr(lmcache_bench, "fio_path", lambda: "/usr/bin/fio")
    args = argparse.Namespace(
        copy_threads=8, queue_depth=64, max_chunk="1MiB", no_fio=no_fio, block=None
    )
    ours = lmcache_bench._spec("dualblade-direct", tmp_path, args, 1 << 20, 1 << 30)
    theirs = lmcache_bench._spec("fs-odirect", tmp_path, args, 1 << 20, 1 << 30)
    if no_fio:
        assert ours["class_name"] == "DualBladeL2Adapter"
        assert "reference_out" not in ours["adapter_params"]
    else:
        assert ours["class_name"] == "ExtentReferenceAdapter"
        assert ours["adapter_params"]["reference_out"] == str(tmp_path / "extent-reference.json")
        assert ours["adapter_params"]["policy"] == "direct"
    assert theirs["type"] == "fs"
