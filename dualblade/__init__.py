"""dualblade: dual-path NVMe-direct KV-cache offloading for LLM inference (DUAL-BLADE).

The front door::

    from dualblade import open_store, load_config

    async with open_store(load_config("configs/default.toml")) as store:
        async with store.context() as ctx:
            await ctx.write(0, k, v)

The rooms behind it import only downwards (``docs/architecture.md``): ``commands -> bench ->
(models, integrations) -> store -> actors -> io_engine``, with ``pipeline`` (the pure plan)
consulted by the store and above. The names below load on first use, so that ``import
dualblade`` (and the CLI, which imports ``dualblade.errors``) does not pay for torch until a
store is wanted.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the subpackage that exports it
_EXPORTS: dict[str, str] = {
    "open_store": "dualblade.store",
    "open_store_blocking": "dualblade.store",
    "KVStore": "dualblade.store",
    "KVContext": "dualblade.store",
    "StoreStats": "dualblade.store",
    "ReadBuffers": "dualblade.store",
    "SharePolicy": "dualblade.store",
    "FairShares": "dualblade.store",
    "FirstComeShares": "dualblade.store",
    "BlockingStore": "dualblade.store",
    "BlockingContext": "dualblade.store",
    "KVShapeError": "dualblade.store",
    "ContextClosedError": "dualblade.store",
    "LayerLostError": "dualblade.store",
    "load_config": "dualblade.pipeline",
    "load_default_config": "dualblade.pipeline",
    "PipelineConfig": "dualblade.pipeline",
    "Medium": "dualblade.pipeline",
    "PlanError": "dualblade.pipeline",
    "ExtentOverflowError": "dualblade.pipeline",
    "MemoryDiscoveryError": "dualblade.pipeline",
    "DualbladeError": "dualblade.errors",
    "ConfigError": "dualblade.errors",
    "IOEngineError": "dualblade.io_engine",
    "IOFailedError": "dualblade.io_engine",
    "TargetError": "dualblade.io_engine",
    "IoUringUnavailableError": "dualblade.io_engine",
    "BufferBusyError": "dualblade.io_engine",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from dualblade.errors import ConfigError as ConfigError
    from dualblade.errors import DualbladeError as DualbladeError
    from dualblade.io_engine import BufferBusyError as BufferBusyError
    from dualblade.io_engine import IOEngineError as IOEngineError
    from dualblade.io_engine import IOFailedError as IOFailedError
    from dualblade.io_engine import IoUringUnavailableError as IoUringUnavailableError
    from dualblade.io_engine import TargetError as TargetError
    from dualblade.pipeline import ExtentOverflowError as ExtentOverflowError
    from dualblade.pipeline import Medium as Medium
    from dualblade.pipeline import MemoryDiscoveryError as MemoryDiscoveryError
    from dualblade.pipeline import PipelineConfig as PipelineConfig
    from dualblade.pipeline import PlanError as PlanError
    from dualblade.pipeline import load_config as load_config
    from dualblade.pipeline import load_default_config as load_default_config
    from dualblade.store import BlockingContext as BlockingContext
    from dualblade.store import BlockingStore as BlockingStore
    from dualblade.store import ContextClosedError as ContextClosedError
    from dualblade.store import FairShares as FairShares
    from dualblade.store import FirstComeShares as FirstComeShares
    from dualblade.store import KVContext as KVContext
    from dualblade.store import KVShapeError as KVShapeError
    from dualblade.store import KVStore as KVStore
    from dualblade.store import LayerLostError as LayerLostError
    from dualblade.store import ReadBuffers as ReadBuffers
    from dualblade.store import SharePolicy as SharePolicy
    from dualblade.store import StoreStats as StoreStats
    from dualblade.store import open_store as open_store
    from dualblade.store import open_store_blocking as open_store_blocking


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dualblade' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
