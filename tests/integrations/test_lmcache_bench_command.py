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
