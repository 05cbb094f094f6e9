"""Inference on top of the KV store: an OPT decoder run layer by layer, a transformers Cache.

- :mod:`.architecture`, :mod:`.weights`, :mod:`.checkpoint`: what an OPT model is, its random
  or loaded parameters;
- :mod:`.kv`: the cache interface the engine runs against and the in-memory reference;
- :mod:`.layer_walk`: a request's decode steps over its layers, reads ahead of the compute and
  into the next step;
- :mod:`.opt`: the layer-by-layer engine with prefetch of the next layer's KV;
- :mod:`.factory`: from a preset, a policy and a workload to a model, a config and a provider;
- :mod:`.hf_cache`: ``DualBladeCache`` for transformers (imported from there: it needs the
  ``hf`` extra): ``from dualblade.models import DualBladeCache`` loads it on first use.
"""

from typing import TYPE_CHECKING, Any

from dualblade.models.architecture import OptArchitecture as OptArchitecture
from dualblade.models.checkpoint import load_checkpoint as load_checkpoint
from dualblade.models.checkpoint import save_checkpoint as save_checkpoint
from dualblade.models.factory import POLICIES as POLICIES
from dualblade.models.factory import build_model as build_model
from dualblade.models.factory import compute_dtype as compute_dtype
from dualblade.models.factory import open_kv as open_kv
from dualblade.models.factory import random_prompts as random_prompts
from dualblade.models.factory import store_config as store_config
from dualblade.models.kv import KVCache as KVCache
from dualblade.models.kv import KVProvider as KVProvider
from dualblade.models.kv import MemoryKV as MemoryKV
from dualblade.models.layer_walk import LayerWalk as LayerWalk
from dualblade.models.layer_walk import UseLayer as UseLayer
from dualblade.models.opt import Generation as Generation
from dualblade.models.opt import OptModel as OptModel
from dualblade.models.weights import OptWeights as OptWeights
from dualblade.models.weights import random_weights as random_weights

if TYPE_CHECKING:
    from dualblade.models.hf_cache import DualBladeCache as DualBladeCache
    from dualblade.models.hf_cache import DualBladeCacheError as DualBladeCacheError

#: Loaded on first use: they need transformers (the ``hf`` extra); the rest of models does not.
_HF_NAMES = {"DualBladeCache", "DualBladeCacheError"}


def __getattr__(name: str) -> Any:
    if name in _HF_NAMES:
        from dualblade.models import hf_cache

        return getattr(hf_cache, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
