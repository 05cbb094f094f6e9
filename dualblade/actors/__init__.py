"""Who moves it: budgeter, binder, copy-thread, GPU-DMA and strategy-probe actors.

Actors import nothing from ``pipeline`` or ``store``: their messages carry plain data (budgets,
block runs, byte spans, buffers, tensors). The store's runtime wires them together. Each actor's
message types are exported beside it; :mod:`.spans` holds the storage spans the copy threads
drive (the :class:`StorageSpan` protocol's implementations, one per path).
"""

from dualblade.actors import fast_sync as fast_sync
from dualblade.actors._base import Actor as Actor
from dualblade.actors._base import ActorStoppedError as ActorStoppedError
from dualblade.actors._base import Reply as Reply
from dualblade.actors._extents import ExtentAllocator as ExtentAllocator
from dualblade.actors._extents import ExtentExhaustedError as ExtentExhaustedError
from dualblade.actors.binder import BinderActor as BinderActor
from dualblade.actors.binder import BinderMessage as BinderMessage
from dualblade.actors.binder import Book as Book
from dualblade.actors.binder import ClaimExtent as ClaimExtent
from dualblade.actors.binder import ClaimFile as ClaimFile
from dualblade.actors.binder import GetBook as GetBook
from dualblade.actors.binder import ReleaseContext as ReleaseContext
from dualblade.actors.binder import Released as Released
from dualblade.actors.budgeter import Budget as Budget
from dualblade.actors.budgeter import BudgeterActor as BudgeterActor
from dualblade.actors.budgeter import BudgeterMessage as BudgeterMessage
from dualblade.actors.budgeter import GetBudget as GetBudget
from dualblade.actors.budgeter import Refresh as Refresh
from dualblade.actors.copy_messages import CopyMessage as CopyMessage
from dualblade.actors.copy_messages import Landing as Landing
from dualblade.actors.copy_messages import Load as Load
from dualblade.actors.copy_messages import RowView as RowView
from dualblade.actors.copy_messages import StorageSpan as StorageSpan
from dualblade.actors.copy_messages import Store as Store
from dualblade.actors.copy_messages import TransferStats as TransferStats
from dualblade.actors.copy_thread import CopyThreadActor as CopyThreadActor
from dualblade.actors.gpu_dma import Copy as Copy
from dualblade.actors.gpu_dma import GpuDmaActor as GpuDmaActor
from dualblade.actors.row_staging import ROW_STAGING_BYTES as ROW_STAGING_BYTES
from dualblade.actors.row_staging import stages_rows as stages_rows
from dualblade.actors.spans import DirectSpan as DirectSpan
from dualblade.actors.spans import MmapSpan as MmapSpan
from dualblade.actors.spans import PageCacheSpan as PageCacheSpan
from dualblade.actors.spans import PathCounters as PathCounters
from dualblade.actors.spans import check_write_back as check_write_back
from dualblade.actors.spans import count_residency as count_residency
from dualblade.actors.spans import host_view as host_view
from dualblade.actors.strategy_probe import BudgetChanged as BudgetChanged
from dualblade.actors.strategy_probe import GetStrategy as GetStrategy
from dualblade.actors.strategy_probe import IterationEnd as IterationEnd
from dualblade.actors.strategy_probe import IterationStart as IterationStart
from dualblade.actors.strategy_probe import OverlapGate as OverlapGate
from dualblade.actors.strategy_probe import ProbeMessage as ProbeMessage
from dualblade.actors.strategy_probe import ProbeState as ProbeState
from dualblade.actors.strategy_probe import StrategyName as StrategyName
from dualblade.actors.strategy_probe import StrategyProbeActor as StrategyProbeActor
from dualblade.actors.strategy_probe import TrafficChanged as TrafficChanged
