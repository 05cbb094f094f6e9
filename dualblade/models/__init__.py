"""Inference on top of the KV store: an OPT decoder run layer by layer, a transformers Cache.

- :mod:`.architecture`, :mod:`.weights`, :mod:`.checkpoint`: what an OPT model is, its random
  or loaded parameters;
- :mod:`.kv`: the cache interface the engine runs against and the in-memory reference;
- :mod:`.opt`: the layer-by-layer engine with prefetch of the next layer's KV;
- :mod:`.factory`: from a preset, a policy and a workload to a model, a config and a provider;
- :mod:`.hf_cache`: ``DualBladeCache`` for transformers (imported from there: it needs the
  ``hf`` extra).
"""

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
from dualblade.models.opt import Generation as Generation
from dualblade.models.opt import OptModel as OptModel
from dualblade.models.weights import OptWeights as OptWeights
from dualblade.models.weights import random_weights as random_weights
