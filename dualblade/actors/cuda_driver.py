"""The few CUDA driver calls the GPU-DMA actor queues a copy with, made without letting go of
the GIL.

Queuing a copy through torch is five calls that each release the GIL and take it back
(``wait_stream``'s record and wait, ``copy_``, the done event's record). On the event-loop
thread each release let the ring thread or the DMA completions thread in, and the loop then
waited for it to hand the GIL back: on the H200 machine, with a tmpfs target, the GPU-DMA
actor's handler took a fifth of the loop's GIL-holding samples (py-spy, docs/pipeline-profile.md)
for calls that take 1-6 us each when nothing else runs. The driver's enqueue calls return in
microseconds, so here they are made through ``ctypes.PyDLL``, which keeps the GIL; only
:meth:`DriverEvent.synchronize`, which sleeps until the copy ends, releases it.

The driver's handles are the runtime's (``torch.cuda.Stream.cuda_stream`` is a ``CUstream``),
and the calls run in torch's context (the device's primary context, current on the thread that
opened the store). Where ``libcuda`` cannot be loaded or no context is current,
:func:`load_driver` returns None and the actor queues through torch as before.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

_SUCCESS = 0
_NOT_READY = 600  # CUDA_ERROR_NOT_READY: cuEventQuery's "still running"
_EVENT_DISABLE_TIMING = 0x2


class CudaDriverError(RuntimeError):
    """A driver call failed: its name and the driver's error code."""


class CudaDriver:
    """``libcuda`` calls bound for one context.

    Args:
        held: the library through ``ctypes.PyDLL`` (calls keep the GIL).
        released: the same library through ``ctypes.CDLL`` (calls release it).
        context: the ``CUcontext`` the calls run in.
    """

    def __init__(self, held: Any, released: Any, context: int) -> None:
        self._held = held
        self._released = released
        self.context = context
        self._bound = threading.local()
        vp, size, u64, uint = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_uint
        signatures: dict[str, tuple[Any, list[Any]]] = {
            "cuEventCreate": (held, [ctypes.POINTER(vp), uint]),
            "cuEventDestroy_v2": (held, [vp]),
            "cuEventRecord": (held, [vp, vp]),
            "cuEventQuery": (held, [vp]),
            "cuStreamWaitEvent": (held, [vp, vp, uint]),
            "cuMemcpyHtoDAsync_v2": (held, [u64, vp, size, vp]),
            "cuMemcpyDtoHAsync_v2": (held, [vp, u64, size, vp]),
            "cuEventSynchronize": (released, [vp]),
            "cuCtxSetCurrent": (held, [vp]),
            "cuCtxGetCurrent": (held, [ctypes.POINTER(vp)]),
        }
        for name, (library, argtypes) in signatures.items():
            function = getattr(library, name)
            function.argtypes = argtypes
            function.restype = ctypes.c_int

    def _call(self, function: Callable[..., int], name: str, *args: Any) -> None:
        code = function(*args)
        if code != _SUCCESS:
            raise CudaDriverError(f"{name} failed: CUDA driver error {code}")

    def is_current(self) -> bool:
        """Whether this context is the calling thread's current one (a caller that switched
        devices since has another, and the copy then goes through torch)."""
        current = ctypes.c_void_p()
        code = self._held.cuCtxGetCurrent(ctypes.byref(current))
        return code == _SUCCESS and current.value == self.context

    def new_event(self) -> int:
        """A fresh event without timing (the cheapest kind to record and wait for)."""
        handle = ctypes.c_void_p()
        self._call(
            self._held.cuEventCreate, "cuEventCreate", ctypes.byref(handle), _EVENT_DISABLE_TIMING
        )
        assert handle.value is not None
        return handle.value

    def destroy_event(self, event: int) -> None:
        self._call(self._held.cuEventDestroy_v2, "cuEventDestroy", event)

    def record(self, event: int, stream: int) -> None:
        self._call(self._held.cuEventRecord, "cuEventRecord", event, stream)

    def wait(self, stream: int, event: int) -> None:
        """Work queued on ``stream`` from now on starts after ``event``'s last record."""
        self._call(self._held.cuStreamWaitEvent, "cuStreamWaitEvent", stream, event, 0)

    def copy_to_device(
        self, device_address: int, host_address: int, nbytes: int, stream: int
    ) -> None:
        self._call(
            self._held.cuMemcpyHtoDAsync_v2,
            "cuMemcpyHtoDAsync",
            device_address,
            host_address,
            nbytes,
            stream,
        )

    def copy_to_host(
        self, host_address: int, device_address: int, nbytes: int, stream: int
    ) -> None:
        self._call(
            self._held.cuMemcpyDtoHAsync_v2,
            "cuMemcpyDtoHAsync",
            host_address,
            device_address,
            nbytes,
            stream,
        )

    def query(self, event: int) -> bool:
        """True once the work recorded before ``event`` has finished."""
        code = self._held.cuEventQuery(event)
        if code == _NOT_READY:
            return False
        if code != _SUCCESS:
            raise CudaDriverError(f"cuEventQuery failed: CUDA driver error {code}")
        return True

    def bind(self) -> None:
        """Make this context current on the calling thread (the engine's or the completions'
        thread, which torch never touched), so the calls above work there too."""
        if not self.is_current():
            self._call(self._held.cuCtxSetCurrent, "cuCtxSetCurrent", self.context)

    def synchronize(self, event: int) -> None:
        """Sleep (GIL released) until ``event``'s work has finished; from any thread."""
        if not getattr(self._bound, "context", False):
            self.bind()
            self._bound.context = True
        self._call(self._released.cuEventSynchronize, "cuEventSynchronize", event)


class DriverEvent:
    """One recorded event, in the shape :class:`~dualblade.actors.dma_completions.DmaCompletions`
    waits for."""

    __slots__ = ("_driver", "handle")

    def __init__(self, driver: CudaDriver, handle: int) -> None:
        self._driver = driver
        self.handle = handle

    def synchronize(self) -> None:
        self._driver.synchronize(self.handle)

    def query(self) -> bool:
        return self._driver.query(self.handle)


def load_driver() -> CudaDriver | None:
    """The driver bound to the calling thread's current context, or None (no ``libcuda``, or
    no context current: torch has not touched the device on this thread)."""
    try:
        held = ctypes.PyDLL("libcuda.so.1")
        released = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    current = held.cuCtxGetCurrent
    current.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    current.restype = ctypes.c_int
    context = ctypes.c_void_p()
    if current(ctypes.byref(context)) != _SUCCESS or not context.value:
        return None
    return CudaDriver(held, released, context.value)
