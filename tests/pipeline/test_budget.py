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


def test_writing_the_page_cache_leaves_the_budget_where_it_was():
    """What the kernel charges for the page cache's own metadata (reclaimable slab: ext4's
    buffer heads, about 2.7 % of the cached bytes) goes with the pages, so a budget read after
    the store wrote its layers equals the one read before: the plan made on the first reading
    still fits the later ones."""
    before = CgroupMemory(2, "/run", 11 * GIB, usage_bytes=GIB, file_bytes=0)
    written = 8 * GIB
    metadata = int(written * 0.027)
    after = CgroupMemory(
        2,
        "/run",
        11 * GIB,
        usage_bytes=GIB + written + metadata,
        file_bytes=written,
        reclaimable_kernel_bytes=metadata,
    )
    host = HostMemory(total_bytes=128 * GIB, available_bytes=100 * GIB, file_bytes=0)
    budgets = [
        derive_budget(
            limit_from_snapshot(MemorySnapshot(host, cgroup)),
            pin_bytes=64 * MIB,
            copy_threads=4,
            safety_margin=GIB,
            safety_fraction=0.05,
        ).page_cache_bytes
        for cgroup in (before, after)
    ]
    assert budgets[0] == budgets[1] == 11 * GIB - GIB - 4 * 64 * MIB - GIB


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


def test_pinned_buffers_already_in_use_are_reserved_once():
    # A running store reads its limit after allocating its two 136 MiB buffers: the limit's
    # in-use memory holds them, so only what is not yet allocated is reserved on top.
    in_use = 1 * GIB + 272 * MIB
    kwargs = {"pin_bytes": 136 * MIB, "copy_threads": 2, "safety_margin": 0, "safety_fraction": 0}
    counted_twice = derive_budget(MemoryLimit(6 * GIB, in_use, "test"), **kwargs)
    once = derive_budget(MemoryLimit(6 * GIB, in_use, "test"), pinned_in_use=272 * MIB, **kwargs)
    assert once.page_cache_bytes == 6 * GIB - in_use
    assert once.page_cache_bytes - counted_twice.page_cache_bytes == 272 * MIB
    assert once.pinned_reservation_bytes == 272 * MIB  # the cost itself is unchanged
    assert once.pinned_still_reserved_bytes == 0
    assert once.to_dict()["pinned_in_use_bytes"] == 272 * MIB
    half = derive_budget(MemoryLimit(6 * GIB, in_use, "test"), pinned_in_use=136 * MIB, **kwargs)
    assert half.page_cache_bytes == 6 * GIB - in_use - 136 * MIB


def test_memory_reserved_but_not_touched_is_kept_out_once():
    """An application's buffers count once: untouched, as ``reserved``; touched, in use."""
    kwargs = {"pin_bytes": 0, "copy_threads": 1, "safety_margin": 0, "safety_fraction": 0}
    before = derive_budget(MemoryLimit(6 * GIB, 1 * GIB, "test"), reserved=2 * GIB, **kwargs)
    half = derive_budget(MemoryLimit(6 * GIB, 2 * GIB, "test"), reserved=1 * GIB, **kwargs)
    after = derive_budget(MemoryLimit(6 * GIB, 3 * GIB, "test"), **kwargs)
    assert before.page_cache_bytes == half.page_cache_bytes == after.page_cache_bytes == 3 * GIB
    assert before.to_dict()["reserved_bytes"] == 2 * GIB
    assert ("- reserved, not touched yet", 2 * GIB) in [(t.name, t.nbytes) for t in before.terms()]
    assert "- reserved, not touched yet" not in [t.name for t in after.terms()]


def test_a_stated_limit_reserves_the_pinned_buffers_whatever_is_allocated(tmp_path):
    from dualblade.pipeline import budget_for, config_from_mapping

    config = config_from_mapping(
        {
            "model": {"num_layers": 2, "hidden_size": 512, "num_heads": 8},
            "workload": {"batch": 2, "prompt_len": 8, "max_new_tokens": 2},
            "storage": {"direct": {"kind": "file", "path": str(tmp_path / "d.kv")}},
        },
        source="test",
        env={},
    )
    stated = budget_for(config, 1 * GIB, pinned_in_use=1 * MIB)
    assert stated.pinned_in_use_bytes == 0  # nothing of the process is in a stated limit
    assert stated.pinned_still_reserved_bytes == stated.pinned_reservation_bytes


def test_two_images_per_buffer_are_reserved_twice(tmp_path):
    """On CUDA each copy thread's buffer holds two KPU images: the budget pays for both."""
    from dualblade.pipeline import budget_for, config_from_mapping, pin_bytes, pin_images_for

    config = config_from_mapping(
        {
            "model": {"num_layers": 2, "hidden_size": 512, "num_heads": 8},
            "workload": {"batch": 2, "prompt_len": 8, "max_new_tokens": 2},
            "copy_threads": 3,
            "storage": {"direct": {"kind": "file", "path": str(tmp_path / "d.kv")}},
        },
        source="test",
        env={},
    )
    assert (pin_images_for("cuda"), pin_images_for("cpu")) == (2, 1)
    one = budget_for(config, 1 * GIB)
    two = budget_for(config, 1 * GIB, pin_images=2)
    assert two.pinned_reservation_bytes == 2 * one.pinned_reservation_bytes == 6 * pin_bytes(config)
    assert one.page_cache_bytes - two.page_cache_bytes == 3 * pin_bytes(config)
    assert two.to_dict()["pin_images"] == 2
    assert "3 threads × 2 images × M_pin" in " ".join(t.note for t in two.terms())
    # A discovered limit already holds the allocated buffers: both images, counted once.
    in_use = derive_budget(
        MemoryLimit(1 * GIB, 6 * pin_bytes(config), "test"),
        pin_bytes=pin_bytes(config),
        copy_threads=3,
        safety_margin=0,
        safety_fraction=0,
        pinned_in_use=6 * pin_bytes(config),
        pin_images=2,
    )
    assert in_use.pinned_still_reserved_bytes == 0
    assert in_use.page_cache_bytes == 1 * GIB - 6 * pin_bytes(config)


def test_the_room_for_rows_is_reserved_with_the_images(tmp_path):
    """A CUDA copy thread's buffer ends in room for appended rows: the budget pays for it
    beside the images, and says so."""
    from dualblade.pipeline import budget_for, config_from_mapping, pin_bytes

    def config(**memory: str):
        return config_from_mapping(
            {
                "model": {"num_layers": 2, "hidden_size": 512, "num_heads": 8},
                "workload": {"batch": 2, "prompt_len": 8, "max_new_tokens": 2},
                "copy_threads": 3,
                "memory": memory,
                "storage": {"direct": {"kind": "file", "path": str(tmp_path / "d.kv")}},
            },
            source="test",
            env={},
        )

    room = 2 * MIB + 8192
    images = budget_for(config(), 1 * GIB, pin_images=2)
    rows = budget_for(config(), 1 * GIB, pin_images=2, row_room=room)
    assert rows.pinned_reservation_bytes == 3 * (2 * pin_bytes(config()) + room)
    assert images.page_cache_bytes - rows.page_cache_bytes == 3 * room
    assert rows.to_dict()["row_room_bytes"] == room
    assert f"rows {room} B" in " ".join(t.note for t in rows.terms())
    # A stated budget carries the room too, for the reservation it reports.
    stated = budget_for(config(page_cache_budget="64MiB"), pin_images=2, row_room=room)
    assert stated.pinned_reservation_bytes == rows.pinned_reservation_bytes
