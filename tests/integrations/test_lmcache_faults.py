"""Failures stay with their keys, and close() lets go of everything, also with tasks in flight.

Faults come from :mod:`dualblade.testing`'s targets around the store's direct target and its
page-cache files: they travel the engine's and the store's real error paths.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dualblade.integrations.lmcache import AdapterClosedError
from dualblade.testing import (
    FaultKind,
    FaultLog,
    FaultPolicy,
    FaultyPageCacheFile,
    FaultyTarget,
)

from .conftest import Driver, MakeAdapter, digest, empty_obj, key, random_obj

OBJ = 16 << 10


class Faults:
    """One policy and log for the direct target and every page-cache file of an adapter."""

    def __init__(self, policy: FaultPolicy) -> None:
        self.policy = policy
        self.log = FaultLog()
        self.targets: list[FaultyTarget] = []

    def options(self) -> dict[str, Any]:
        def direct(target: Any) -> FaultyTarget:
            faulty = FaultyTarget(target, self.policy, log=self.log)
            self.targets.append(faulty)
            return faulty

        def page_cache_file(path: Path, size: int) -> FaultyPageCacheFile:
            return FaultyPageCacheFile(path, size, self.policy, self.log)

        return {"wrap_direct": direct, "page_cache_file": page_cache_file}

    def hard(self) -> int:
        return sum(1 for f in self.log.injected if f.kind.hard)


def test_a_read_error_fails_only_the_keys_it_hit(make_adapter: MakeAdapter) -> None:
    faults = Faults(FaultPolicy(1.0, kinds=(FaultKind.EIO,)))
    faults.policy.enabled = False
    adapter = make_adapter("direct", object_size=OBJ, store_options=faults.options())
    drive = Driver(adapter)
    keys = [key(i) for i in range(6)]
    objects = [random_obj(OBJ, seed=i) for i in range(6)]
    assert drive.store(keys, objects).is_successful()

    where = adapter.placement(keys[2])
    assert where is not None
    assert where.medium == "direct"
    assert where.direct_bytes is not None
    start, end = where.direct_bytes
    assert end - start == OBJ  # its K and V: consecutive blocks
    faults.targets[0].limit_to(start, end)
    faults.policy.enabled = True
    targets = [empty_obj(OBJ) for _ in keys]
    assert drive.load(keys, targets) == [True, True, False, True, True, True]
    assert faults.hard() >= 1
    assert all(digest(targets[i]) == digest(objects[i]) for i in (0, 1, 3, 4, 5))
    assert adapter.stats().load_failures == 1

    # later calls keep working, and the key's bytes were not lost
    assert drive.store([key("later")], [random_obj(OBJ, seed=9)]).is_successful()
    faults.policy.enabled = False
    again = empty_obj(OBJ)
    assert drive.load([keys[2]], [again]) == [True]
    assert digest(again) == digest(objects[2])


@pytest.mark.parametrize("policy", ["direct", "page-cache"])
def test_write_errors_fail_their_keys_and_free_their_storage(
    make_adapter: MakeAdapter, policy: str
) -> None:
    faults = Faults(FaultPolicy(0.3, seed=5, kinds=(FaultKind.EIO,)))
    adapter = make_adapter(policy, object_size=OBJ, store_options=faults.options())
    drive = Driver(adapter)
    keys = [key(i) for i in range(16)]
    objects = [random_obj(OBJ, seed=i) for i in range(16)]
    result = drive.store(keys, objects)
    faults.policy.enabled = False
    held = drive.lookup(keys)
    adapter.submit_unlock(keys)
    failed = [k for k, here in zip(keys, held, strict=True) if not here]
    assert not result.is_successful()
    assert 1 <= len(failed) <= faults.hard()  # each failed key met a fault of its own
    assert len(failed) < len(keys)
    stats = adapter.stats()
    assert stats.store_failures == len(failed)
    assert stats.store["open_contexts"] == stats.objects == len(keys) - len(failed)
    assert adapter.get_usage().total_bytes_used == stats.objects * OBJ

    for k, obj, here in zip(keys, objects, held, strict=True):
        if here:
            target = empty_obj(OBJ)
            assert drive.load([k], [target]) == [True]
            assert digest(target) == digest(obj)
    # the failed keys store now that the disk is well again
    retry = [objects[keys.index(k)] for k in failed]
    assert drive.store(failed, retry).is_successful()
    assert drive.lookup(keys) == [True] * len(keys)


def _threads() -> set[threading.Thread]:
    return set(threading.enumerate())


def test_close_with_loads_in_flight_releases_everything(make_adapter: MakeAdapter) -> None:
    make_adapter("direct").close()  # LMCache's own threads (event bus ...) start with the first
    before = _threads()
    faults = Faults(FaultPolicy(1.0, kinds=(FaultKind.SLOW,), slow_s=0.2))
    faults.policy.enabled = False
    adapter = make_adapter("direct", object_size=OBJ, store_options=faults.options())
    drive = Driver(adapter)
    keys = [key(i) for i in range(3)]
    assert drive.store(keys, [random_obj(OBJ, seed=i) for i in range(3)]).is_successful()
    faults.policy.enabled = True  # every completion now takes 0.2 s

    targets = [empty_obj(OBJ, fill=0x5A) for _ in keys]
    adapter.submit_load_task(keys, targets)
    adapter.submit_store_task([key("late")], [random_obj(OBJ, seed=7)])
    time.sleep(0.05)
    adapter.close()
    landed = [t.tensor.clone() for t in targets]
    time.sleep(0.5)  # nothing of a cancelled load lands after close() returned
    assert all(torch.equal(t.tensor, snap) for t, snap in zip(targets, landed, strict=True))

    stats = adapter.stats()  # the last snapshot, taken while closing
    assert stats.objects == 0
    assert stats.held_bytes == 0
    assert stats.store["open_contexts"] == 0
    assert stats.store["extents_held"] == 0
    assert stats.store["trimmed_blocks"] >= 3 * OBJ // 4096
    assert _threads() <= before  # the loop thread and the ring thread are gone
    adapter.close()  # idempotent
    with pytest.raises(AdapterClosedError):
        adapter.submit_load_task(keys, targets)
    adapter.submit_unlock(keys)  # harmless after close
    adapter.delete(keys)


def test_close_with_stores_in_flight_keeps_none_of_them(make_adapter: MakeAdapter) -> None:
    faults = Faults(FaultPolicy(1.0, kinds=(FaultKind.SLOW,), slow_s=0.2))
    adapter = make_adapter("page-cache", object_size=OBJ, store_options=faults.options())
    pc = Path(adapter.setup.config.storage.page_cache_dir)
    adapter.submit_store_task([key(i) for i in range(4)], [random_obj(OBJ, i) for i in range(4)])
    time.sleep(0.05)
    adapter.close()
    stats = adapter.stats()
    assert stats.objects == 0
    assert stats.store["open_contexts"] == 0
    assert stats.store["files_held"] == 0
    assert not [p for p in pc.rglob("*") if p.is_file()]  # every page-cache file unlinked
