"""What goes where: the pipeline config, the budget and Algorithm 1, the LBA map and Algorithm 2.

Planning code here is pure (no I/O but reading memory limits) and is unit-tested without storage.
Public names are re-exported flat from here; the modules hold one idea each:

- :mod:`.config`, :mod:`.config_loader`: ``PipelineConfig`` and reading it from TOML/YAML/env;
- :mod:`.config_builder`: a config for a model shape and workload the caller knows;
- :mod:`.sizes`: the size parser and the bytes / blocks / LBA types;
- :mod:`.shapes`: model shapes, presets and KV byte arithmetic;
- :mod:`.memory`, :mod:`.budget`: memory discovery and the page-cache budget ``B_pc``;
- :mod:`.placement`: Algorithm 1;
- :mod:`.kpu`, :mod:`.layout`, :mod:`.lba_map`: KPUs, their padded layout, the LBA map;
- :mod:`.slicing`: Algorithm 2;
- :mod:`.read_ahead`: the order a decode step reads its layers in (direct ones early);
- :mod:`.planner`: a whole plan from a config.
"""

from dualblade.pipeline.budget import BudgetTerm as BudgetTerm
from dualblade.pipeline.budget import MemoryLimit as MemoryLimit
from dualblade.pipeline.budget import PageCacheBudget as PageCacheBudget
from dualblade.pipeline.budget import derive_budget as derive_budget
from dualblade.pipeline.budget import explicit_limit as explicit_limit
from dualblade.pipeline.budget import fixed_budget as fixed_budget
from dualblade.pipeline.budget import limit_from_snapshot as limit_from_snapshot
from dualblade.pipeline.config import BlockTarget as BlockTarget
from dualblade.pipeline.config import FileTarget as FileTarget
from dualblade.pipeline.config import MemorySection as MemorySection
from dualblade.pipeline.config import ModelSection as ModelSection
from dualblade.pipeline.config import NvmeTarget as NvmeTarget
from dualblade.pipeline.config import PipelineConfig as PipelineConfig
from dualblade.pipeline.config import Policy as Policy
from dualblade.pipeline.config import StorageSection as StorageSection
from dualblade.pipeline.config import Strategy as Strategy
from dualblade.pipeline.config import TelemetrySection as TelemetrySection
from dualblade.pipeline.config import WorkloadSection as WorkloadSection
from dualblade.pipeline.config import default_cache_dir as default_cache_dir
from dualblade.pipeline.config_builder import config_for_model as config_for_model
from dualblade.pipeline.config_loader import ENV_PREFIX as ENV_PREFIX
from dualblade.pipeline.config_loader import apply_env_overrides as apply_env_overrides
from dualblade.pipeline.config_loader import config_from_mapping as config_from_mapping
from dualblade.pipeline.config_loader import config_json_schema as config_json_schema
from dualblade.pipeline.config_loader import load_config as load_config
from dualblade.pipeline.config_loader import load_default_config as load_default_config
from dualblade.pipeline.errors import ExtentOverflowError as ExtentOverflowError
from dualblade.pipeline.errors import MemoryDiscoveryError as MemoryDiscoveryError
from dualblade.pipeline.errors import PlanError as PlanError
from dualblade.pipeline.kpu import KpuId as KpuId
from dualblade.pipeline.kpu import TensorKind as TensorKind
from dualblade.pipeline.kpu import layer_kpus as layer_kpus
from dualblade.pipeline.layer_order import LAYER_ORDERS as LAYER_ORDERS
from dualblade.pipeline.layer_order import LayerOrder as LayerOrder
from dualblade.pipeline.layer_order import page_cache_order as page_cache_order
from dualblade.pipeline.layout import TensorLayout as TensorLayout
from dualblade.pipeline.lba_map import KpuExtent as KpuExtent
from dualblade.pipeline.lba_map import LbaMap as LbaMap
from dualblade.pipeline.lba_map import Region as Region
from dualblade.pipeline.medium import Medium as Medium
from dualblade.pipeline.memory import CgroupLocation as CgroupLocation
from dualblade.pipeline.memory import CgroupMemory as CgroupMemory
from dualblade.pipeline.memory import HostMemory as HostMemory
from dualblade.pipeline.memory import MemorySnapshot as MemorySnapshot
from dualblade.pipeline.memory import discover_memory as discover_memory
from dualblade.pipeline.memory import find_memory_cgroup as find_memory_cgroup
from dualblade.pipeline.memory import read_cgroup_v1 as read_cgroup_v1
from dualblade.pipeline.memory import read_cgroup_v2 as read_cgroup_v2
from dualblade.pipeline.memory import read_meminfo as read_meminfo
from dualblade.pipeline.placement import Placement as Placement
from dualblade.pipeline.placement import assign_groups as assign_groups
from dualblade.pipeline.placement import place_layers as place_layers
from dualblade.pipeline.planner import Plan as Plan
from dualblade.pipeline.planner import budget_for as budget_for
from dualblade.pipeline.planner import layer_page_cache_bytes as layer_page_cache_bytes
from dualblade.pipeline.planner import make_plan as make_plan
from dualblade.pipeline.planner import pin_bytes as pin_bytes
from dualblade.pipeline.planner import pin_images_for as pin_images_for
from dualblade.pipeline.planner import pin_images_in_plan as pin_images_in_plan
from dualblade.pipeline.planner import tensor_layout as tensor_layout
from dualblade.pipeline.read_ahead import ReadAhead as ReadAhead
from dualblade.pipeline.read_ahead import decode_read_buffers as decode_read_buffers
from dualblade.pipeline.shapes import DTYPE_BYTES as DTYPE_BYTES
from dualblade.pipeline.shapes import PRESETS as PRESETS
from dualblade.pipeline.shapes import DType as DType
from dualblade.pipeline.shapes import ModelShape as ModelShape
from dualblade.pipeline.shapes import get_preset as get_preset
from dualblade.pipeline.sizes import PAGE_SIZE as PAGE_SIZE
from dualblade.pipeline.sizes import BlockCount as BlockCount
from dualblade.pipeline.sizes import ByteCount as ByteCount
from dualblade.pipeline.sizes import Lba as Lba
from dualblade.pipeline.sizes import format_size as format_size
from dualblade.pipeline.sizes import parse_size as parse_size
from dualblade.pipeline.slicing import Chunk as Chunk
from dualblade.pipeline.slicing import RowRange as RowRange
from dualblade.pipeline.slicing import SlicePlan as SlicePlan
from dualblade.pipeline.slicing import plan_slice as plan_slice
