"""The adapter through LMCache's interface: store, lookup and lock, unlock, load, with checksums;
submissions from several threads at once; usage and hit statistics."""

from __future__ import annotations

import argparse
import json
import threading

import pytest
import torch

from dualblade.integrations.lmcache import DualBladeL2Adapter
from dualblade.io_engine import AlignedBuffer

from .conftest import Driver, MakeAdapter, digest, empty_obj, key, memory_obj, random_obj


@pytest.mark.parametrize("policy", ["direct", "page-cache", "dual"])
def test_store_lookup_load_round_trip(make_adapter: MakeAdapter, policy: str) -> None:
    adapter = make_adapter(policy)
    drive = Driver(adapter)
    # whole rows (views of the object), a ragged tail, one row, and an odd start (both staged)
    sizes = [64 << 10, 64 << 10, 40_000, 4096, 1, 8191]
    keys = [key(i) for i in range(len(sizes))]
    objects = [random_obj(n, seed=i, offset=1 if i == 5 else 0) for i, n in enumerate(sizes)]
    sums = [digest(o) for o in objects]

    assert drive.lookup(keys) == [False] * len(keys)
    adapter.submit_unlock(keys)  # LMCache unlocks what it looked up, found or not
    result = drive.store(keys, objects)
    assert result.is_successful()
    assert result.bytes_transferred() == sum(sizes)
    assert drive.lookup(keys) == [True] * len(keys)

    targets = [empty_obj(n) for n in sizes]
    assert drive.load(keys, targets) == [True] * len(keys)
    assert [digest(t) for t in targets] == sums
    adapter.submit_unlock(keys)

    usage = adapter.get_usage()
    assert usage.total_bytes_used == sum(sizes)
    assert usage.total_capacity_bytes == 4 << 20
    stats = adapter.stats()
    assert stats.objects == len(keys)
    assert sum(stats.placed.values()) == len(keys)
    assert set(stats.placed) <= {"direct", "page-cache"}
    assert (stats.lookups, stats.lookup_hits) == (2 * len(keys), len(keys))
    assert (stats.loads, stats.load_hits) == (len(keys), len(keys))
    moved = sum(stats.store["read_bytes"].values())
    assert moved >= sum(sizes)  # the store's own counters saw every byte (padded to rows)


def test_a_missing_key_fails_only_its_bit(make_adapter: MakeAdapter) -> None:
    adapter = make_adapter()
    drive = Driver(adapter)
    stored = [key("a"), key("c")]
    objects = [random_obj(5000, seed=1), random_obj(7000, seed=2)]
    assert drive.store(stored, objects).is_successful()
    targets = [empty_obj(5000), empty_obj(100), empty_obj(7000)]
    assert drive.load([key("a"), key("b"), key("c")], targets) == [True, False, True]
    assert digest(targets[0]) == digest(objects[0])
    assert digest(targets[2]) == digest(objects[1])
    assert bytes(targets[1].tensor.numpy()) == b"\xa5" * 100  # a miss leaves the buffer alone


def test_a_buffer_of_the_wrong_size_fails_its_key(make_adapter: MakeAdapter) -> None:
    adapter = make_adapter()
    drive = Driver(adapter)
    assert drive.store([key(1)], [random_obj(8192, seed=1)]).is_successful()
    assert drive.load([key(1)], [empty_obj(4096)]) == [False]
    assert adapter.stats().load_failures == 1
    target = empty_obj(8192)
    assert drive.load([key(1)], [target]) == [True]  # and the object is still there


def test_storing_a_key_again_keeps_the_first_bytes(make_adapter: MakeAdapter) -> None:
    adapter = make_adapter()
    drive = Driver(adapter)
    first = random_obj(4096, seed=1)
    assert drive.store([key(1)], [first]).bytes_transferred() == 4096
    again = drive.store([key(1)], [random_obj(4096, seed=2)])
    assert again.is_successful()
    assert again.bytes_transferred() == 0
    target = empty_obj(4096)
    assert drive.load([key(1)], [target]) == [True]
    assert digest(target) == digest(first)
    assert adapter.get_usage().total_bytes_used == 4096
    assert adapter.stats().store_skipped == 1


def test_an_object_larger_than_object_size_fails_its_key_only(make_adapter: MakeAdapter) -> None:
    adapter = make_adapter()
    drive = Driver(adapter)
    result = drive.store([key("big"), key("small")], [random_obj(65 << 10, 1), random_obj(10, 2)])
    assert not result.is_successful()  # one key failed: LMCache keeps both in L1
    assert drive.lookup([key("big"), key("small")]) == [False, True]


def test_concurrent_submits_from_many_threads(make_adapter: MakeAdapter) -> None:
    """LMCache's store and prefetch controllers call from their own threads; here eight threads
    submit at once, each its own keys, and every result lands under its own task id."""
    adapter = make_adapter("dual", capacity="8MiB")
    drive = Driver(adapter)
    threads_n, per_thread = 8, 6
    objects = {
        (t, i): random_obj(3000 + 7919 * i + 13 * t, seed=100 * t + i)
        for t in range(threads_n)
        for i in range(per_thread)
    }
    tasks: dict[int, list[tuple[int, int]]] = {}
    lock = threading.Lock()
    start = threading.Barrier(threads_n)

    def submit(t: int) -> None:
        start.wait()
        for i in range(per_thread):  # one key per task: many small tasks in flight together
            task = adapter.submit_store_task([key((t, i))], [objects[t, i]])
            with lock:
                tasks[task] = [(t, i)]

    workers = [threading.Thread(target=submit, args=(t,)) for t in range(threads_n)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(tasks) == threads_n * per_thread  # distinct task ids
    for task in tasks:
        assert drive.store_result(task).is_successful()

    every = sorted(objects)
    targets = {ti: empty_obj(objects[ti].get_size()) for ti in every}
    loads = []
    for t in range(threads_n):
        mine = [ti for ti in every if ti[0] == t]
        loads.append(
            (adapter.submit_load_task([key(ti) for ti in mine], [targets[ti] for ti in mine]), mine)
        )
    for task, mine in loads:
        assert drive.load_result(task, len(mine)) == [True] * len(mine)
    assert all(digest(targets[ti]) == digest(objects[ti]) for ti in every)


def test_eventfds_are_distinct_and_signalled(make_adapter: MakeAdapter) -> None:
    adapter = make_adapter()
    fds = {
        adapter.get_store_event_fd(),
        adapter.get_lookup_and_lock_event_fd(),
        adapter.get_load_event_fd(),
    }
    assert len(fds) == 3


def test_usage_follows_deletes_and_listeners_hear_them(make_adapter: MakeAdapter) -> None:
    adapter = make_adapter()
    drive = Driver(adapter)
    heard: list[tuple[str, list[object]]] = []

    class Listener:
        def on_l2_keys_stored(self, keys: list[object], sizes: list[int]) -> None:
            heard.append(("stored", list(keys)))

        def on_l2_keys_accessed(self, keys: list[object]) -> None:
            heard.append(("accessed", list(keys)))

        def on_l2_keys_deleted(self, keys: list[object]) -> None:
            heard.append(("deleted", list(keys)))

    adapter.register_listener(Listener())
    keys = [key(i) for i in range(3)]
    assert drive.store(keys, [random_obj(4096, seed=i) for i in range(3)]).is_successful()
    assert drive.load(keys[:1], [empty_obj(4096)]) == [True]
    trimmed = adapter.stats().store["trimmed_blocks"]
    adapter.delete([keys[1], key("never stored")])
    assert adapter.get_usage().total_bytes_used == 2 * 4096
    assert drive.lookup(keys) == [True, False, True]
    assert adapter.stats().store["trimmed_blocks"] > trimmed  # its blocks went back (TRIM)
    assert ("stored", keys) in heard
    assert ("accessed", keys[:1]) in heard
    assert ("deleted", [keys[1]]) in heard


def test_a_plugin_spec_loads_it_as_lmcache_does(tmp_path, monkeypatch) -> None:
    """The JSON that LMCache's server and basic_check take, through LMCache's own factory."""
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    spec = {
        "type": "plugin",
        "module_path": "dualblade.integrations.lmcache",
        "class_name": "DualBladeL2Adapter",
        "adapter_params": {"capacity": "64MiB", "memory": {"page_cache_budget": "16MiB"}},
    }
    config = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)]))
    adapter = create_l2_adapter(config.adapters[0])
    try:
        assert isinstance(adapter, DualBladeL2Adapter)
        assert adapter.supports_global_eviction  # LMCache's eviction sees our capacity
        scratch = adapter.setup.scratch
        assert scratch is not None
        assert scratch.parent == tmp_path / "dualblade"
        drive = Driver(adapter)
        obj = random_obj(1 << 20, seed=7)
        assert drive.store([key(1)], [obj]).is_successful()
        target = empty_obj(1 << 20)
        assert drive.load([key(1)], [target]) == [True]
        assert torch.equal(target.tensor, obj.tensor)
    finally:
        adapter.close()
    assert not scratch.exists()  # the adapter's own folder goes with it


def test_the_last_stats_are_written_at_close(make_adapter: MakeAdapter, tmp_path) -> None:
    adapter = make_adapter(stats_file=str(tmp_path / "out" / "stats.json"))
    drive = Driver(adapter)
    assert drive.store([key(1)], [random_obj(4096, seed=1)]).is_successful()
    assert drive.load([key(1), key(2)], [empty_obj(4096), empty_obj(4096)]) == [True, False]
    adapter.close()
    written = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert (written["loads"], written["load_hits"], written["load_hit_rate"]) == (2, 1, 0.5)
    assert written["placed"] == {"direct": 1}
    assert written["store"]["read_bytes"]["direct"] >= 4096
    assert written["objects"] == 0  # released at close


def test_the_store_wide_budget_places_objects(make_adapter: MakeAdapter) -> None:
    """dual: the page-cache budget (four of 64 KiB objects) over the capacity (ten) puts two
    objects in every five stored on the page cache, spread over the store order so that objects
    loaded together read from both paths; the rest go direct. A deleted page-cache object's
    room goes to the next object the stripe picks, and stored objects are not moved."""
    adapter = make_adapter("dual", capacity="640KiB", memory={"page_cache_budget": "256KiB"})
    drive = Driver(adapter)
    keys = [key(i) for i in range(10)]
    for k in keys:  # one at a time: placed in store order
        assert drive.store([k], [random_obj(64 << 10, seed=1)]).is_successful()
    media = [where.medium for where in map(adapter.placement, keys) if where is not None]
    picked = [0, 2, 5, 7]  # frac(a * 0.618...) < 0.4
    assert media == ["page-cache" if i in picked else "direct" for i in range(10)]
    stats = adapter.stats()
    assert stats.placed == {"page-cache": 4, "direct": 6}
    assert stats.store["ledger"]["placed_bytes"] == 256 << 10
    assert stats.store["ledger"]["demotions"] == stats.store["ledger"]["promotions"] == 0
    adapter.delete([keys[2]])
    nexts = [key(f"next {i}") for i in range(3)]
    for k in nexts:
        assert drive.store([k], [random_obj(64 << 10, seed=2)]).is_successful()
    # arrivals 10, 11, 12: the stripe picks 10, into the room keys[2] left
    assert [adapter.placement(k).medium for k in nexts] == ["page-cache", "direct", "direct"]
    assert adapter.placement(keys[7]).medium == "page-cache"  # stored objects are not moved
    assert [adapter.placement(k) for k in keys[:2]] == [None, None]  # the oldest made room


@pytest.mark.parametrize("policy", ["direct", "page-cache"])
def test_aligned_objects_move_straight_between_lmcache_memory_and_storage(
    make_adapter: MakeAdapter, policy: str
) -> None:
    """LMCache's L1 is 4096-aligned (``--l1-align-bytes 4096``): storage reads into its objects
    and writes from them itself, with no copy thread and no copy (the store's straight
    transfers)."""
    adapter = make_adapter(policy)
    drive = Driver(adapter)
    size, n = 64 << 10, 4
    with AlignedBuffer(2 * n * size) as l1:
        memory = l1.tensor()
        torch.manual_seed(5)
        memory[: n * size] = torch.randint(0, 256, (n * size,), dtype=torch.uint8)
        sources = [memory_obj(memory[i * size : (i + 1) * size]) for i in range(n)]
        targets = [memory_obj(memory[(n + i) * size : (n + i + 1) * size]) for i in range(n)]
        keys = [key(f"aligned-{i}") for i in range(n)]
        initial = adapter.stats().store
        assert drive.store(keys, sources).is_successful()
        before = adapter.stats().store
        assert before["co_dma"] == initial["co_dma"]  # the stores went straight too
        assert drive.lookup(keys) == [True] * n
        assert drive.load(keys, targets) == [True] * n
        adapter.submit_unlock(keys)
        assert [digest(t) for t in targets] == [digest(s) for s in sources]
        after = adapter.stats().store
        path = "direct" if policy == "direct" else "page-cache"
        assert after["read_bytes"][path] - before["read_bytes"].get(path, 0) == n * size
        # no copy thread moved these loads: no transfer, no host copy out of a pinned buffer
        assert after["co_dma"] == before["co_dma"]
        del sources, targets, memory


@pytest.mark.parametrize("policy", ["direct", "page-cache"])
def test_a_load_buffer_of_the_wrong_size_fails_its_key_only(
    make_adapter: MakeAdapter, policy: str
) -> None:
    """A buffer that is whole rows but not the object's size (the straight path's check) and
    one that is not whole rows (the staged path's) each fail their key; the object stays, and a
    buffer of the right size loads it."""
    adapter = make_adapter(policy)
    drive = Driver(adapter)
    stored = random_obj(64 << 10, seed=5)
    assert drive.store([key(1)], [stored]).is_successful()
    assert drive.load([key(1)], [empty_obj(32 << 10)]) == [False]
    assert drive.load([key(1)], [empty_obj((64 << 10) + 512)]) == [False]
    good = empty_obj(64 << 10)
    assert drive.load([key(1)], [good]) == [True]
    assert digest(good) == digest(stored)
    assert adapter.stats().load_failures == 2
