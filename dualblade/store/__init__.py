"""The running pipeline users hold: ``open_store``, ``KVStore``, ``KVContext``.

The store turns the plan (:mod:`dualblade.pipeline`) into moving bytes: its runtime opens the
targets and the I/O engine, starts and wires the five actors, and applies each new plan; each
context materializes its storage on first use and releases it on close; :mod:`.media` maps each
layer's medium to the span that moves it. Code above the store reads ``KVStore.stats()``.

- :mod:`.kv_store`: ``KVStore`` and ``open_store``;
- :mod:`.context`: ``KVContext``, one request's KV cache; :mod:`.tensor_shape` checks its input;
- :mod:`.media`: the medium -> span table;
- :mod:`.runtime`, :mod:`.direct_target`, :mod:`.copy_thread_pool`: starting and wiring it all;
- :mod:`.stats`: the typed snapshot; :mod:`.blocking`: the facade for synchronous callers;
- :mod:`.dtypes`: dtype names and torch dtypes; :mod:`.errors`: what a context raises;
- :mod:`.residency_ledger`, :mod:`.share_policy`, :mod:`.replanner`, :mod:`.layer_moves`,
  :mod:`.context_storage`: one page-cache budget for all contexts, and live re-planning;
- :mod:`.straight_transfers`: a whole layer between storage and the caller's host memory, no
  copy thread.
"""

from dualblade.store.blocking import BlockingContext as BlockingContext
from dualblade.store.blocking import BlockingStore as BlockingStore
from dualblade.store.blocking import open_store_blocking as open_store_blocking
from dualblade.store.context import KVContext as KVContext
from dualblade.store.dtypes import TORCH_DTYPES as TORCH_DTYPES
from dualblade.store.dtypes import dtype_name as dtype_name
from dualblade.store.dtypes import torch_dtype as torch_dtype
from dualblade.store.errors import ContextClosedError as ContextClosedError
from dualblade.store.errors import KVShapeError as KVShapeError
from dualblade.store.errors import LayerLostError as LayerLostError
from dualblade.store.kv_store import KVStore as KVStore
from dualblade.store.kv_store import open_store as open_store
from dualblade.store.pin_layout import PinLayout as PinLayout
from dualblade.store.pin_layout import pin_layout_for as pin_layout_for
from dualblade.store.read_buffers import ReadBuffers as ReadBuffers
from dualblade.store.reclaim import Reclaimed as Reclaimed
from dualblade.store.residency_ledger import LedgerSnapshot as LedgerSnapshot
from dualblade.store.share_policy import ContextDemand as ContextDemand
from dualblade.store.share_policy import FairShares as FairShares
from dualblade.store.share_policy import FirstComeShares as FirstComeShares
from dualblade.store.share_policy import NewcomerShare as NewcomerShare
from dualblade.store.share_policy import SharePolicy as SharePolicy
from dualblade.store.stats import CoDmaStats as CoDmaStats
from dualblade.store.stats import StoreStats as StoreStats
from dualblade.store.straight_transfers import read_layer_straight as read_layer_straight
from dualblade.store.straight_transfers import write_layer_straight as write_layer_straight
