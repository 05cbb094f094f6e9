"""``dualblade iobench`` on a namespace: our passthrough path beside fio's ``io_uring_cmd``.

Run inside ``scripts/nvme-vm``; elsewhere every test skips. iobench writes from offset 0, which
is slot 0 of the namespace, the one the other tests never use. Imports torch (the bench package
does): about 40 s once per session in the TCG guest.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dualblade.bench import IoBenchConfig, run_iobench
from dualblade.errors import ConfigError
from dualblade.io_engine import NvmeNamespace

MiB = 1 << 20


def _config(path: Path, block_size: int, *, use_fio: bool) -> IoBenchConfig:
    return IoBenchConfig(
        path=str(path),
        size=16 * MiB,
        block_size=block_size,
        queue_depth=8,
        runs=1,
        use_fio=use_fio,
        page_cache=False,
        request_bytes=4 * MiB,
    )


def test_iobench_drives_the_namespace_through_passthrough_beside_fio(
    nvme_namespace_path: Path,
) -> None:
    use_fio = shutil.which("fio") is not None
    result = run_iobench(_config(nvme_namespace_path, 128 << 10, use_fio=use_fio)).to_json()
    target = result["target"]
    assert isinstance(target, dict)
    assert target["kind"] == "NvmeNamespace"
    assert result["engine"] == "io_uring"
    results = result["results"]
    assert isinstance(results, dict)
    for op in ("read", "write"):
        assert results["direct"][op]["median_bytes_per_s"] > 0
    if use_fio:  # fio's io_uring_cmd engine moved the same commands
        ratios = result["direct_vs_fio"]
        assert isinstance(ratios, dict)
        assert ratios["read"] > 0
        assert ratios["write"] > 0


def test_iobench_refuses_blocks_the_namespace_cannot_take_in_one_command(
    nvme_namespace_path: Path,
) -> None:
    if shutil.which("fio") is None:
        pytest.skip("fio is not installed: the limit only matters beside fio")
    with NvmeNamespace(str(nvme_namespace_path)) as namespace:
        limit = namespace.max_transfer
    too_big = (limit // 4096 + 1) * 4096  # iobench blocks are multiples of 4 KiB
    with pytest.raises(ConfigError, match=f"takes at most {limit} bytes per command"):
        run_iobench(_config(nvme_namespace_path, too_big, use_fio=True))
