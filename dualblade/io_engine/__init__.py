"""How bytes move: liburing bindings, the ring thread, storage targets and aligned buffers.

io_engine knows nothing of KV caches: it moves byte ranges between
:class:`AlignedBuffer` memory and :class:`Target` storage, through the io_uring ring (or the
thread-pool compatibility engine where io_uring is unavailable).
"""

from dualblade.io_engine._waker import LoopCaller as LoopCaller
from dualblade.io_engine._waker import loop_caller as loop_caller
from dualblade.io_engine.buffer_window import BufferWindow as BufferWindow
from dualblade.io_engine.buffers import HUGE_PAGE_SIZE as HUGE_PAGE_SIZE
from dualblade.io_engine.buffers import PAGE_SIZE as PAGE_SIZE
from dualblade.io_engine.buffers import AlignedBuffer as AlignedBuffer
from dualblade.io_engine.buffers import BorrowedBuffer as BorrowedBuffer
from dualblade.io_engine.engine import CompatMode as CompatMode
from dualblade.io_engine.engine import IOEngine as IOEngine
from dualblade.io_engine.errors import BufferBusyError as BufferBusyError
from dualblade.io_engine.errors import IOEngineError as IOEngineError
from dualblade.io_engine.errors import IOFailedError as IOFailedError
from dualblade.io_engine.errors import IoUringUnavailableError as IoUringUnavailableError
from dualblade.io_engine.errors import TargetError as TargetError
from dualblade.io_engine.fio import FioResult as FioResult
from dualblade.io_engine.fio import fio_path as fio_path
from dualblade.io_engine.fio import run_fio as run_fio
from dualblade.io_engine.native import describe_chunk_pump as describe_chunk_pump
from dualblade.io_engine.opcodes import Op as Op
from dualblade.io_engine.probe import IoUringProbe as IoUringProbe
from dualblade.io_engine.probe import probe as probe
from dualblade.io_engine.ring import ChunkObserver as ChunkObserver
from dualblade.io_engine.storage_slots import StorageSlots as StorageSlots
from dualblade.io_engine.targets import BlockDevice as BlockDevice
from dualblade.io_engine.targets import DirectFile as DirectFile
from dualblade.io_engine.targets import NvmeNamespace as NvmeNamespace
from dualblade.io_engine.targets import PageCacheFile as PageCacheFile
from dualblade.io_engine.targets import Target as Target
from dualblade.io_engine.targets.direct_file import DIRECT_FILE_ALIGNMENT as DIRECT_FILE_ALIGNMENT
from dualblade.io_engine.thread_names import name_os_thread as name_os_thread
from dualblade.io_engine.thread_names import named_thread as named_thread
