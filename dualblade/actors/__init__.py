"""Who moves it: budgeter, binder, copy-thread, GPU-DMA and strategy-probe actors.

Actors import nothing from ``pipeline``: their messages carry plain data (budgets, block runs,
byte spans, buffers, tensors). The pipeline's runtime wires them together.
"""

from dualblade.actors._base import Actor as Actor
from dualblade.actors._base import ActorStoppedError as ActorStoppedError
from dualblade.actors._base import Reply as Reply
from dualblade.actors._extents import ExtentAllocator as ExtentAllocator
from dualblade.actors._extents import ExtentExhaustedError as ExtentExhaustedError
from dualblade.actors.binder import BinderActor as BinderActor
from dualblade.actors.budgeter import Budget as Budget
from dualblade.actors.budgeter import BudgeterActor as BudgeterActor
from dualblade.actors.copy_thread import CopyThreadActor as CopyThreadActor
from dualblade.actors.copy_thread import Load as Load
from dualblade.actors.copy_thread import RowView as RowView
from dualblade.actors.copy_thread import StorageSpan as StorageSpan
from dualblade.actors.copy_thread import Store as Store
from dualblade.actors.copy_thread import TransferStats as TransferStats
from dualblade.actors.gpu_dma import GpuDmaActor as GpuDmaActor
from dualblade.actors.strategy_probe import OverlapGate as OverlapGate
from dualblade.actors.strategy_probe import StrategyProbeActor as StrategyProbeActor
