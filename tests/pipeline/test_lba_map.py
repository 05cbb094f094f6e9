"""The LBA map: contiguous, disjoint, aligned, inside the declared extent — or refused."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualblade.pipeline import (
    ExtentOverflowError,
    KpuId,
    LbaMap,
    PlanError,
    Region,
    layer_kpus,
)


def test_hand_computed():
    kpus = layer_kpus([3, 4])
    assert [str(k) for k in kpus] == ["L3.K", "L3.V", "L4.K", "L4.V"]
    lba_map = LbaMap.bind([(k, 8192) for k in kpus], Region(100, 1000), 4096)
    assert [(e.lba_start, e.n_blocks) for e in lba_map] == [(100, 2), (102, 2), (104, 2), (106, 2)]
    assert lba_map.lookup(KpuId(4, "K")).lba_start == 104
    assert lba_map.lookup(KpuId(4, "K")).byte_offset == 104 * 4096
    assert lba_map.used_blocks == 8
    assert (lba_map.start, lba_map.end) == (100, 108)
    assert KpuId(3, "V") in lba_map
    assert KpuId(0, "K") not in lba_map
    with pytest.raises(PlanError, match="page-cache path"):
        lba_map.lookup(KpuId(0, "K"))
    assert lba_map.extents[0].to_dict() == {
        "kpu": "L3.K",
        "lba_start": 100,
        "n_blocks": 2,
        "byte_offset": 409600,
        "nbytes": 8192,
    }


def test_second_context_starts_where_the_first_ends():
    region = Region(0, 16)
    first = LbaMap.bind([(KpuId(0, "K"), 4096 * 4)], region, 4096)
    second = LbaMap.bind([(KpuId(0, "K"), 4096 * 4)], region, 4096, start=first.end)
    assert second.start == 4


def test_exact_fit_and_overflow():
    tensors = [(k, 4096 * 5) for k in layer_kpus([0, 1])]
    assert LbaMap.bind(tensors, Region(10, 20), 4096).end == 30
    with pytest.raises(ExtentOverflowError, match=r"need 20 blocks .* ends at LBA 29"):
        LbaMap.bind(tensors, Region(10, 19), 4096)


def test_refusals():
    with pytest.raises(PlanError, match="not a positive multiple"):
        LbaMap.bind([(KpuId(0, "K"), 1000)], Region(0, 10), 512)
    with pytest.raises(PlanError, match="bound twice"):
        LbaMap.bind([(KpuId(0, "K"), 512)] * 2, Region(0, 10), 512)
    with pytest.raises(PlanError, match="outside the region"):
        LbaMap.bind([], Region(5, 10), 512, start=2)


def test_kpu_names_round_trip():
    assert KpuId.parse("L12.V") == KpuId(12, "V")
    assert sorted([KpuId(1, "K"), KpuId(0, "V"), KpuId(0, "K")]) == list(layer_kpus([0, 1])[:3])
    with pytest.raises(ValueError, match="not a KPU name"):
        KpuId.parse("layer3")


@given(
    st.lists(st.integers(1, 5000), min_size=0, max_size=40),
    st.sampled_from([512, 4096]),
    st.integers(0, 1 << 40),
    st.integers(0, 10_000),
)
def test_invariants(blocks, lba_size, first_lba, slack):
    tensors = [(KpuId(i // 2, "KV"[i % 2]), n * lba_size) for i, n in enumerate(blocks)]
    region = Region(first_lba, sum(blocks) + slack)
    lba_map = LbaMap.bind(tensors, region, lba_size)
    cursor = first_lba
    for extent, n in zip(lba_map, blocks, strict=True):
        assert extent.lba_start == cursor  # contiguous (hence disjoint)
        assert extent.n_blocks == n
        assert extent.nbytes % lba_size == 0
        assert region.first_lba <= extent.lba_start
        assert extent.end <= region.end
        cursor = extent.end
    if slack == 0 and blocks:
        with pytest.raises(ExtentOverflowError):
            LbaMap.bind(tensors, Region(first_lba, sum(blocks) - 1), lba_size)
