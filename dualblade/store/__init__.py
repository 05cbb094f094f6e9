"""The running pipeline users hold: ``open_store``, ``KVStore``, ``KVContext``.

The store turns the plan (:mod:`dualblade.pipeline`) into moving bytes: its runtime opens the
targets and the I/O engine, starts and wires the five actors, and applies each new plan; each
context materializes its storage on first use and releases it on close.
"""

from dualblade.store.blocking import BlockingContext as BlockingContext
from dualblade.store.blocking import BlockingStore as BlockingStore
from dualblade.store.blocking import open_store_blocking as open_store_blocking
from dualblade.store.dtypes import TORCH_DTYPES as TORCH_DTYPES
from dualblade.store.dtypes import dtype_name as dtype_name
from dualblade.store.dtypes import torch_dtype as torch_dtype
from dualblade.store.kv_store import ContextClosedError as ContextClosedError
from dualblade.store.kv_store import KVContext as KVContext
from dualblade.store.kv_store import KVShapeError as KVShapeError
from dualblade.store.kv_store import KVStore as KVStore
from dualblade.store.kv_store import LayerLostError as LayerLostError
from dualblade.store.kv_store import open_store as open_store
