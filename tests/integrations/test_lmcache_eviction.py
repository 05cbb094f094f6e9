"""Capacity: least recently used objects make room, locked and loading ones never do; the books
(:class:`ObjectIndex`) on their own, and the adapter under a capacity of a few objects."""

from __future__ import annotations

import pytest

from dualblade.integrations.lmcache import ObjectIndex

from .conftest import Driver, MakeAdapter, digest, empty_obj, key, random_obj

# -- the books ---------------------------------------------------------------------------------


def _ready(index: ObjectIndex, name: str, size: int = 10) -> None:
    entry = index.reserve(name, size, size)
    index.commit(entry, slot=name, medium="direct")


def test_victims_are_least_recently_used_first() -> None:
    index = ObjectIndex(30)
    for name in "abc":
        _ready(index, name)
    assert index.victims(0) == []
    assert [e.key for e in index.victims(10)] == ["a"]
    index.lookup_and_lock(["a"])  # a lookup makes it recent, and locks it
    index.unlock(["a"])
    assert [e.key for e in index.victims(20)] == ["b", "c"]


def test_locked_loading_and_pending_objects_are_never_victims() -> None:
    index = ObjectIndex(40)
    for name in "abc":
        _ready(index, name)
    index.lookup_and_lock(["a"])
    reading = index.start_read("b")
    assert reading is not None
    index.reserve("d", 10, 10)  # pending: being written
    assert [e.key for e in index.victims(10)] == ["c"]
    assert index.victims(20) is None  # a, b and d cannot go
    index.unlock(["a", "a", "unknown"])  # extra unlocks are harmless
    assert [e.key for e in index.victims(20)] == ["c", "a"]


def test_bytes_stay_held_until_storage_is_released() -> None:
    index = ObjectIndex(20)
    _ready(index, "a")
    _ready(index, "b")
    reading = index.start_read("a")
    assert reading is not None
    gone = index.remove("a", evicted=False)
    assert gone is reading
    assert gone.retired
    assert index.ready("a") is None
    assert index.held_bytes == 20  # its run is still in use by the load
    assert index.finish_read(reading)  # the last reader of a retired object: release it now
    index.released(reading)
    assert index.held_bytes == 10
    assert index.counters.deletes == 1


def test_a_failed_write_gives_its_reservation_back() -> None:
    index = ObjectIndex(10)
    entry = index.reserve("a", 10, 10)
    with pytest.raises(ValueError, match="do not fit"):
        index.reserve("b", 1, 1)
    assert index.lookup_and_lock(["a"]) == [False]  # pending objects are not found
    index.abandon(entry)
    assert index.held_bytes == 0
    assert "a" not in index


# -- the adapter -------------------------------------------------------------------------------
OBJ = 16 << 10  # 16 KiB objects: two 4 KiB rows of K and two of V, no padding


@pytest.mark.parametrize("policy", ["direct", "page-cache"])
def test_a_full_adapter_evicts_the_least_recently_used(
    make_adapter: MakeAdapter, policy: str
) -> None:
    adapter = make_adapter(policy, capacity=4 * OBJ, object_size=OBJ)
    drive = Driver(adapter)
    objects = [random_obj(OBJ, seed=i) for i in range(7)]
    deleted: list[object] = []

    class Listener:
        def on_l2_keys_stored(self, keys: object, sizes: object) -> None: ...
        def on_l2_keys_accessed(self, keys: object) -> None: ...
        def on_l2_keys_deleted(self, keys: list[object]) -> None:
            deleted.extend(keys)

    adapter.register_listener(Listener())
    for i in range(4):
        assert drive.store([key(i)], [objects[i]]).is_successful()
    assert drive.lookup([key(0)]) == [True]  # 0 is now the most recent, and locked
    for i in (4, 5):
        assert drive.store([key(i)], [objects[i]]).is_successful()
    assert deleted == [key(1), key(2)]  # least recently used first; locked 0 stays
    assert drive.lookup([key(i) for i in range(6)]) == [True, False, False, True, True, True]
    assert adapter.get_usage().total_bytes_used == 4 * OBJ
    stats = adapter.stats()
    assert (stats.evictions, stats.objects) == (2, 4)
    assert stats.held_bytes <= stats.capacity_bytes
    if policy == "direct":
        assert stats.store["trimmed_blocks"] >= 2 * OBJ // 4096  # evicted runs were trimmed
    else:
        assert stats.store["files_held"] == 2 * 4  # K and V files of the four left

    # survivors read back whole
    for i in (0, 3, 4, 5):
        target = empty_obj(OBJ)
        assert drive.load([key(i)], [target]) == [True]
        assert digest(target) == digest(objects[i])


def test_when_everything_is_locked_a_store_fails_instead_of_evicting(
    make_adapter: MakeAdapter,
) -> None:
    adapter = make_adapter(capacity=2 * OBJ, object_size=OBJ)
    drive = Driver(adapter)
    keys = [key(i) for i in range(3)]
    assert drive.store(keys[:2], [random_obj(OBJ, seed=i) for i in range(2)]).is_successful()
    assert drive.lookup(keys[:2]) == [True, True]  # both locked
    assert not drive.store(keys[2:], [random_obj(OBJ, seed=2)]).is_successful()
    assert drive.lookup(keys) == [True, True, False]
    adapter.submit_unlock(keys[:2])
    adapter.submit_unlock(keys[:2])  # the second lookup's locks too
    assert drive.store(keys[2:], [random_obj(OBJ, seed=2)]).is_successful()
    assert adapter.stats().evictions == 1


def test_one_task_larger_than_the_capacity_stores_what_fits(make_adapter: MakeAdapter) -> None:
    adapter = make_adapter(capacity=3 * OBJ, object_size=OBJ)
    drive = Driver(adapter)
    keys = [key(i) for i in range(5)]
    objects = [random_obj(OBJ, seed=i) for i in range(5)]
    result = drive.store(keys, objects)  # all five in flight at once: at most three are held
    stats = adapter.stats()
    assert stats.held_bytes <= 3 * OBJ
    found = drive.lookup(keys)
    assert 1 <= sum(found) <= 3
    assert not result.is_successful()  # the keys that found no room fail the task
    assert stats.stored_bytes == sum(found) * OBJ
    for k, obj, here in zip(keys, objects, found, strict=True):
        if here:
            target = empty_obj(OBJ)
            assert drive.load([k], [target]) == [True]
            assert digest(target) == digest(obj)
