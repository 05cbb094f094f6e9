"""Fixtures for the LMCache adapter's tests: adapters on the test's tmp dir, memory objects with
known bytes, and a small driver that waits on the adapter's eventfds as LMCache's controllers do.

The whole folder is skipped, with the reason, where LMCache is not installed (it is an optional
extra; ``scripts/bootstrap`` installs it without CUDA).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import select
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # LMCache reports usage over the net
with warnings.catch_warnings():
    # LMCache's adapters import google-cloud clients that warn about this Python at import
    warnings.simplefilter("ignore")
    try:
        import lmcache.v1.distributed.l2_adapters  # noqa: F401
        from lmcache.v1.distributed.api import ObjectKey
        from lmcache.v1.memory_management import (
            MemoryFormat,
            MemoryObjMetadata,
            TensorMemoryObj,
        )
        from lmcache.v1.platform import consume_fd
    except ImportError as error:  # pragma: no cover - the extra is missing
        pytest.skip(
            f"LMCache is not installed ({error}): pip install 'dualblade[lmcache]', or run "
            "scripts/bootstrap (it installs LMCache without CUDA)",
            allow_module_level=True,
        )

from dualblade.integrations.lmcache import DualBladeL2Adapter

WAIT_S = 30.0

#: What LMCache 0.5.6's imports say about its dependencies, not about the adapter: each of its
#: loggers builds an OpenTelemetry handler that is deprecated, and the Google clients behind
#: its cloud adapters warn about this Python. The suite turns warnings into errors otherwise.
LMCACHE_IMPORT_WARNINGS = (
    "ignore:`LoggingHandler` in `opentelemetry-sdk` is deprecated:DeprecationWarning",
    "ignore:You are using a Python version:FutureWarning",
    "ignore:grpcio < :FutureWarning",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            for rule in LMCACHE_IMPORT_WARNINGS:
                item.add_marker(pytest.mark.filterwarnings(rule))


@pytest.fixture(autouse=True)
def _collector_unfrozen() -> Iterator[None]:
    """An adapter freezes the cyclic collector's view of every object alive when it starts
    (``freeze_gc``); in a test process that is all the tests before it, so each test gives the
    collector its objects back after it."""
    yield
    gc.unfreeze()


def key(name: object, salt: str = "") -> Any:
    """An LMCache object key named ``name``."""
    digest = hashlib.sha256(str(name).encode()).digest()[:16]
    return ObjectKey(chunk_hash=digest, model_name="test-model", kv_rank=0, cache_salt=salt)


def memory_obj(data: torch.Tensor) -> Any:
    """An LMCache memory object over ``data`` (flat, any dtype), as its L1 would hand one over."""
    data = data.reshape(-1)
    meta = MemoryObjMetadata(
        shape=torch.Size([data.numel()]),
        dtype=data.dtype,
        address=data.data_ptr(),
        phy_size=data.numel() * data.element_size(),
        fmt=MemoryFormat.KV_2LTD,
        ref_count=1,
    )
    return TensorMemoryObj(data, meta, parent_allocator=None)


def random_obj(nbytes: int, seed: int, *, offset: int = 0) -> Any:
    """A memory object of ``nbytes`` seeded bytes, starting ``offset`` bytes into its tensor (an
    odd offset makes the adapter stage it)."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes + offset,), dtype=torch.uint8, generator=generator)
    return memory_obj(raw[offset:])


def empty_obj(nbytes: int, fill: int = 0xA5) -> Any:
    return memory_obj(torch.full((nbytes,), fill, dtype=torch.uint8))


def digest(obj: Any) -> str:
    return hashlib.sha256(obj.tensor.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


class Driver:
    """Submits to an adapter and waits for results the way LMCache's controllers do: poll the
    kind's eventfd, drain it, then collect."""

    def __init__(self, adapter: DualBladeL2Adapter) -> None:
        self.adapter = adapter
        self.stores: dict[int, Any] = {}

    def _wait(self, fd: int, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + WAIT_S
        while not done():
            left = deadline - time.monotonic()
            assert left > 0, "the adapter did not signal completion in time"
            readable, _, _ = select.select([fd], [], [], min(left, 0.5))
            if readable:
                with contextlib.suppress(BlockingIOError):  # another waiter drained it
                    consume_fd(fd)

    def store(self, keys: list[Any], objects: list[Any]) -> Any:
        task = self.adapter.submit_store_task(keys, objects)
        return self.store_result(task)

    def store_result(self, task: int) -> Any:
        def done() -> bool:
            self.stores.update(self.adapter.pop_completed_store_tasks())
            return task in self.stores

        self._wait(self.adapter.get_store_event_fd(), done)
        return self.stores.pop(task)

    def lookup(self, keys: list[Any]) -> list[bool]:
        task = self.adapter.submit_lookup_and_lock_task(keys, {})
        return self._bits(task, len(keys), self.adapter.get_lookup_and_lock_event_fd, "lookup")

    def load(self, keys: list[Any], objects: list[Any]) -> list[bool]:
        task = self.adapter.submit_load_task(keys, objects)
        return self._bits(task, len(keys), self.adapter.get_load_event_fd, "load")

    def load_result(self, task: int, n: int) -> list[bool]:
        return self._bits(task, n, self.adapter.get_load_event_fd, "load")

    def _bits(self, task: int, n: int, fd: Callable[[], int], kind: str) -> list[bool]:
        query = (
            self.adapter.query_lookup_and_lock_result
            if kind == "lookup"
            else self.adapter.query_load_result
        )
        found: list[Any] = []

        def done() -> bool:
            result = query(task)
            if result is not None:
                found.append(result)
            return bool(found)

        self._wait(fd(), done)
        return [bool(found[0].test(i)) for i in range(n)]


MakeAdapter = Callable[..., DualBladeL2Adapter]


@pytest.fixture
def make_adapter(tmp_path: Path) -> Iterator[MakeAdapter]:
    """``make_adapter(policy="direct", **params)``: an adapter whose files lie in the test's tmp
    dir, with a fixed page-cache budget (no memory discovery); closed after the test."""
    made: list[DualBladeL2Adapter] = []

    def make(policy: str = "direct", *, store_options: dict[str, Any] | None = None, **params: Any):
        storage = params.pop("storage", {})
        params = {
            "object_size": "64KiB",
            "capacity": "4MiB",
            "policy": policy,
            "copy_threads": 2,
            "memory": {"page_cache_budget": "8MiB"},
            "storage": {
                "page_cache_dir": str(tmp_path / "pc"),
                **storage,
                "direct": {"path": str(tmp_path / "direct.kv"), **storage.get("direct", {})},
            },
            **params,
        }
        adapter = DualBladeL2Adapter(params, **(store_options or {}))
        made.append(adapter)
        return adapter

    yield make
    for adapter in made:
        adapter.close()
