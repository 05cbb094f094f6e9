"""The page-cache budget's derivation, computed by hand."""

import pytest

from dualblade.pipeline import (
    CgroupMemory,
    HostMemory,
    MemoryLimit,
    MemorySnapshot,
    derive_budget,
    explicit_limit,
    fixed_budget,
    limit_from_snapshot,
)

MIB = 1 << 20
GIB = 1 << 30
HOST = HostMemory(total_bytes=16 * GIB, available_bytes=12 * GIB, file_bytes=4 * GIB)


def test_explicit_limit_derivation():
    budget = derive_budget(
        explicit_limit(6 * GIB),
        pin_bytes=136 * MIB,
        copy_threads=2,
        safety_margin=128 * MIB,
        safety_fraction=0.05,
    )
    margin = int(0.05 * 6 * GIB)  # 307.2 MiB beats the 128 MiB floor
    assert budget.safety_margin_bytes == margin
    assert budget.pinned_reservation_bytes == 272 * MIB
    assert budget.page_cache_bytes == 6 * GIB - 272 * MIB - margin
    assert budget.knob_x_bytes == budget.page_cache_bytes
    assert budget.in_use_bytes == 0
    names = [term.name for term in budget.terms()]
    assert names[0] == "memory limit"
    assert names[-2:] == ["= page-cache budget B_pc", "knob X"]
    assert budget.to_dict()["page_cache_bytes"] == budget.page_cache_bytes
    assert next(iter(budget.to_dict())) == "page_cache_bytes"


def test_margin_floor_and_knob_clamp():
    budget = derive_budget(
        MemoryLimit(1 * GIB, 200 * MIB, "test"),
        pin_bytes=10 * MIB,
        copy_threads=4,
        safety_margin=128 * MIB,
        safety_fraction=0.05,
        knob_x=2 * GIB,
    )
    assert budget.safety_margin_bytes == 128 * MIB
    assert budget.page_cache_bytes == 1024 * MIB - 200 * MIB - 40 * MIB - 128 * MIB
    assert budget.knob_x_bytes == budget.page_cache_bytes  # X clamped into [0, B_pc]
    assert budget.knob_x_requested_bytes == 2 * GIB
    smaller = derive_budget(
        MemoryLimit(1 * GIB, 0, "t"),
        pin_bytes=0,
        copy_threads=1,
        safety_margin=0,
        safety_fraction=0.0,
        knob_x=5 * MIB,
    )
    assert smaller.knob_x_bytes == 5 * MIB


def test_budget_never_negative():
    budget = derive_budget(
        explicit_limit(256 * MIB),
        pin_bytes=136 * MIB,
        copy_threads=2,
        safety_margin=128 * MIB,
        safety_fraction=0.05,
    )
    assert budget.page_cache_bytes == 0
    assert budget.knob_x_bytes == 0


def test_fixed_budget():
    budget = fixed_budget(3 * GIB, pin_bytes=MIB, copy_threads=2, knob_x=GIB)
    assert (budget.page_cache_bytes, budget.knob_x_bytes, budget.limit_bytes) == (
        3 * GIB,
        GIB,
        None,
    )
    assert [t.name for t in budget.terms()] == ["page-cache budget B_pc", "knob X"]


def test_limit_from_cgroup():
    cgroup = CgroupMemory(2, "/svc", 6 * GIB, usage_bytes=2 * GIB, file_bytes=GIB + 512 * MIB)
    limit = limit_from_snapshot(MemorySnapshot(HOST, cgroup))
    assert limit.limit_bytes == 6 * GIB
    assert limit.in_use_bytes == 512 * MIB  # the cgroup's page cache is reclaimable
    assert limit.source == "cgroup v2 /svc"


def test_host_caps_a_generous_cgroup():
    host = HostMemory(total_bytes=16 * GIB, available_bytes=3 * GIB, file_bytes=0)
    cgroup = CgroupMemory(1, "/x", 32 * GIB, usage_bytes=0, file_bytes=0)
    limit = limit_from_snapshot(MemorySnapshot(host, cgroup))
    assert limit.limit_bytes == 16 * GIB  # never above MemTotal
    assert limit.limit_bytes - limit.in_use_bytes == 3 * GIB  # nor above what the host has free


@pytest.mark.parametrize("cgroup", [None, CgroupMemory(1, "/u", None, 10, 5)])
def test_no_limit_uses_the_host(cgroup):
    limit = limit_from_snapshot(MemorySnapshot(HOST, cgroup))
    assert limit.limit_bytes == 16 * GIB
    assert limit.in_use_bytes == 4 * GIB
    assert "host MemTotal" in limit.source
