"""adapter_params: the embedded default with the adapter's own folder, a config file with keys
laid over it, and one clear error for each kind of mistake, at construction."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from dualblade.integrations.lmcache import (
    AdapterParamsError,
    DualBladeL2Adapter,
    ObjectGeometry,
    resolve_params,
)


@pytest.fixture(autouse=True)
def _cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name in list(os.environ):
        if name.startswith("DUALBLADE__"):
            monkeypatch.delenv(name)


def test_empty_params_run_the_embedded_default_in_a_folder_of_its_own(tmp_path: Path) -> None:
    first, second = resolve_params({}), resolve_params(None)
    try:
        config = first.config
        assert first.scratch is not None
        assert first.scratch.parent == tmp_path / "cache" / "dualblade"
        assert config.storage.direct.kind == "file"
        assert config.storage.direct.path == first.scratch / "direct.kv"
        assert config.storage.page_cache_dir == first.scratch / "page-cache"
        assert second.scratch != first.scratch  # two adapters never share a file
        assert config.storage.direct.extent_size == first.capacity == 4 << 30
        assert config.memory.knob_x is None  # the page-cache share follows the budget
        assert config.copy_threads == 8
        assert first.replan is False  # stored objects stay where they were placed
        assert first.stats_file is None
        assert first.geometry == ObjectGeometry(row_bytes=4096, max_rows=128)  # 1 MiB objects
        shape = config.shape()
        assert (shape.num_layers, shape.dtype) == (1, "float16")
        assert config.workload.max_len == 128
    finally:
        first.remove_scratch()
        second.remove_scratch()
    assert not first.scratch.exists()


def test_a_config_file_with_keys_laid_over_it(tmp_path: Path) -> None:
    path = tmp_path / "kv.toml"
    path.write_text(
        'policy = "direct"\ncopy_threads = 3\n[model]\npreset = "opt-125m"\n'
        "[workload]\nbatch = 1\nprompt_len = 8\nmax_new_tokens = 0\n"
        f'[storage]\npage_cache_dir = "{tmp_path}/pc"\n'
        f'[storage.direct]\npath = "{tmp_path}/d.kv"\nextent_size = "1GiB"\n'
    )
    setup = resolve_params(
        {"config": str(path), "copy_threads": 5, "object_size": "256KiB", "capacity": "512MiB"}
    )
    assert setup.scratch is None  # every path is the file's
    assert setup.config.policy == "direct"
    assert setup.config.copy_threads == 5
    assert setup.config.storage.direct.path == tmp_path / "d.kv"
    assert setup.capacity == 512 << 20
    assert setup.geometry.max_rows == 32  # 256 KiB: 32 rows of K, 32 of V
    assert setup.config.shape().num_layers == 1  # the file's model is the adapter's to set


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"capcity": "1GiB"}, r"adapter_params\.capcity: unknown key; the keys allowed are"),
        ({"model": {"preset": "opt-1.3b"}}, r"adapter_params\.model: the adapter sets"),
        ({"workload": {}}, r"adapter_params\.workload"),
        ({"capacity": "lots"}, r"adapter_params\.capacity: 'lots' is not a size"),
        ({"object_size": 0}, r"adapter_params\.object_size must be positive"),
        ({"copy_threads": 0}, r"copy_threads: Input should be greater than or equal to 1"),
        ({"storage": {"direct": {"kind": "tape"}}}, r"kind must be one of"),
        ({"config": "/nonexistent/kv.toml"}, r"adapter_params\.config: .*No such file"),
        ({"config": 7}, r"adapter_params\.config must be a file path"),
        ({"replan": "yes"}, r"adapter_params\.replan must be true or false"),
        ({"populate_l1": 1}, r"adapter_params\.populate_l1 must be true or false"),
        ({"freeze_gc": "no"}, r"adapter_params\.freeze_gc must be true or false"),
        ({"stats_file": 3}, r"adapter_params\.stats_file must be a path"),
        (
            {
                "capacity": "2GiB",
                "storage": {"direct": {"kind": "block", "path": "/dev/x", "extent_size": "1GiB"}},
            },
            r"capacity \(2147483648 bytes\) is more than the direct target's extent_size",
        ),
    ],
)
def test_bad_params_fail_at_construction_with_the_key(params: dict, message: str) -> None:
    with pytest.raises(AdapterParamsError, match=message):
        DualBladeL2Adapter(params)


def test_a_failed_construction_leaves_no_folder(tmp_path: Path) -> None:
    with pytest.raises(AdapterParamsError):
        DualBladeL2Adapter({"copy_threads": 0})
    assert list((tmp_path / "cache" / "dualblade").glob("lmcache-*")) == []


@dataclasses.dataclass(frozen=True)
class _L1Desc:
    """What the adapter reads of LMCache's L1 description."""

    ptr: int
    size: int


def _l1_and_params(tmp_path: Path, **own: object) -> tuple[torch.Tensor, _L1Desc, dict]:
    """64 MiB of "L1" (large: mapped, not yet resident), its first 16 MiB touched, as LMCache
    describes it, and params with the store's files under ``tmp_path``."""
    l1 = torch.empty(64 << 20, dtype=torch.uint8)
    l1[: 16 << 20].fill_(1)
    files = {"page_cache_dir": str(tmp_path / "pc"), "direct": {"path": str(tmp_path / "d")}}
    return l1, _L1Desc(l1.data_ptr(), l1.numel()), {"storage": files, **own}


def test_untouched_l1_is_kept_out_of_the_page_cache_budget(tmp_path: Path) -> None:
    """LMCache's L1 that nobody touched yet is not in use yet: the adapter keeps it out of the
    budget, and asks again at every reading, so what LMCache touches later is counted once
    (with ``populate_l1`` off: the adapter leaves L1 as LMCache made it)."""
    from dualblade.integrations.lmcache import DualBladeL2Adapter as Adapter

    l1, desc, params = _l1_and_params(tmp_path, populate_l1=False)
    adapter = Adapter(params, l1_memory_desc=desc)
    try:
        read_budget = adapter.objects.store.runtime.budgeter._read  # a reading, as it polls

        def reserved_now() -> int:
            return read_budget().detail.reserved_bytes

        assert 40 << 20 <= reserved_now() <= 48 << 20  # the untouched 48 MiB (huge pages aside)
        l1[16 << 20 : 48 << 20].fill_(2)
        assert 8 << 20 <= reserved_now() <= 16 << 20
    finally:
        adapter.close()


def test_l1_is_made_resident_at_the_start_with_its_bytes_kept(tmp_path: Path) -> None:
    """By default the adapter makes all of L1 resident before its store opens (so its loads'
    O_DIRECT lands in pages had while memory was free), leaving what LMCache wrote as it was;
    nothing of L1 is then left to reserve."""
    from dualblade.integrations.lmcache import DualBladeL2Adapter as Adapter
    from dualblade.integrations.lmcache.l1_memory import untouched_bytes

    l1, desc, params = _l1_and_params(tmp_path)
    assert untouched_bytes(desc.ptr, desc.size) >= 40 << 20
    adapter = Adapter(params, l1_memory_desc=desc)
    try:
        assert untouched_bytes(desc.ptr, desc.size) == 0
        assert adapter.objects.store.runtime.budgeter._read().detail.reserved_bytes == 0
        assert bool((l1[: 16 << 20] == 1).all())
        assert bool((l1[16 << 20 :] == 0).all())
    finally:
        adapter.close()


@pytest.mark.parametrize("freeze", [True, False])
def test_the_collector_is_frozen_at_the_start_unless_told_not_to(
    tmp_path: Path, freeze: bool
) -> None:
    """By default the objects alive when the adapter starts leave the cyclic collector's
    passes (a full pass over them stalled loads for 300 ms); ``freeze_gc: false`` leaves the
    collector as the host process set it."""
    import gc

    from dualblade.integrations.lmcache import DualBladeL2Adapter as Adapter

    gc.unfreeze()
    files = {"page_cache_dir": str(tmp_path / "pc"), "direct": {"path": str(tmp_path / "d")}}
    adapter = Adapter({"storage": files, "capacity": "8MiB", "freeze_gc": freeze})
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 10_000 if freeze else frozen == 0
    finally:
        adapter.close()
        gc.unfreeze()


@pytest.mark.parametrize("value", [[0], [1, 2, 3, 4], "700", [700, "10"], [True], []])
def test_a_bad_gc_threshold_is_refused(value: Any) -> None:
    with pytest.raises(AdapterParamsError, match=r"adapter_params\.gc_threshold must be null"):
        resolve_params({"gc_threshold": value})


@pytest.mark.parametrize(
    ("given", "applied"), [(None, None), ([9000], (9000,)), ("default", (50_000, 20, 100))]
)
def test_the_collector_runs_less_often_while_the_adapter_is_open(
    tmp_path: Path, given: Any, applied: tuple[int, ...] | None
) -> None:
    """The adapter's thresholds hold while it is open (a full pass holds the GIL the ring
    thread needs), and the host process's come back when it closes; null leaves them."""
    import gc

    host = gc.get_threshold()
    files = {"page_cache_dir": str(tmp_path / "pc"), "direct": {"path": str(tmp_path / "d")}}
    params: dict[str, Any] = {"storage": files, "capacity": "8MiB", "freeze_gc": False}
    if given != "default":
        params["gc_threshold"] = given
    adapter = DualBladeL2Adapter(params)
    try:
        now = gc.get_threshold()
        assert now == host if applied is None else now[: len(applied)] == applied
    finally:
        adapter.close()
    assert gc.get_threshold() == host


@pytest.mark.parametrize("value", [0, -0.001, 2, "0.001", True, [0.001]])
def test_a_bad_switch_interval_is_refused(value: Any) -> None:
    with pytest.raises(AdapterParamsError, match=r"adapter_params\.switch_interval must be null"):
        resolve_params({"switch_interval": value})


@pytest.mark.parametrize(("given", "applied"), [(None, None), (0.002, 0.002), ("default", 0.0005)])
def test_the_gil_changes_hands_sooner_while_the_adapter_is_open(
    tmp_path: Path, given: Any, applied: float | None
) -> None:
    """The adapter's switch interval holds while it is open (the ring thread, woken by the disk,
    waits for the GIL at most that long), and the host process's comes back when it closes;
    null leaves it."""
    import sys

    host = 0.004  # not Python's default, so that a reset to the default would be caught
    before = sys.getswitchinterval()
    sys.setswitchinterval(host)
    files = {"page_cache_dir": str(tmp_path / "pc"), "direct": {"path": str(tmp_path / "d")}}
    params: dict[str, Any] = {"storage": files, "capacity": "8MiB", "freeze_gc": False}
    if given != "default":
        params["switch_interval"] = given
    try:
        adapter = DualBladeL2Adapter(params)
        try:
            now = sys.getswitchinterval()
            assert now == pytest.approx(host if applied is None else applied, rel=1e-3)
        finally:
            adapter.close()
        assert sys.getswitchinterval() == pytest.approx(host, rel=1e-3)
    finally:
        sys.setswitchinterval(before)
