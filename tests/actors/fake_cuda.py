"""A fake ``libcuda`` for tests without a GPU: it records each call (name, thread, arguments),
answers with the codes a test sets, keeps a current context per thread, and can move the bytes of
a copy between two host addresses."""

from __future__ import annotations

import ctypes
import threading
from types import SimpleNamespace
from typing import Any

from dualblade.actors.cuda_driver import CudaDriver
from dualblade.actors.dma_completions import DmaCompletions
from dualblade.actors.gpu_dma import GpuDmaActor
from dualblade.io_engine import loop_caller

CONTEXT = 0x5000


class FakeFunction:
    def __init__(self, library: FakeLibrary, name: str) -> None:
        self.library, self.name = library, name
        self.argtypes: list[Any] = []
        self.restype: Any = None

    def __call__(self, *args: Any) -> int:
        self.library.calls.append((self.name, threading.current_thread().name, args))
        if self.name == "cuEventCreate":
            args[0]._obj.value = 0x100 + len(self.library.calls)  # byref(c_void_p)
        if self.name == "cuCtxGetCurrent":
            args[0]._obj.value = self.library.current
        if self.name == "cuCtxSetCurrent":
            self.library.current = args[0]
        if self.name in ("cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2") and self.library.move:
            destination, source, nbytes, _ = args
            ctypes.memmove(destination, source, nbytes)  # "device" memory is host memory here
        return self.library.codes.get(self.name, 0)


class FakeLibrary:
    """libcuda's calls, recorded; the current context is per thread, as the driver's is (the
    thread that made the fake has ``CONTEXT``, the others none until they set one)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, tuple[Any, ...]]] = []
        self.codes: dict[str, int] = {}
        self._maker = threading.get_ident()
        self._current: dict[int, int | None] = {self._maker: CONTEXT}
        self._functions: dict[str, FakeFunction] = {}
        self.move = False  # copies move the bytes (both sides are host memory in the test)

    @property
    def current(self) -> int | None:
        return self._current.get(threading.get_ident())

    @current.setter
    def current(self, context: int | None) -> None:
        self._current[threading.get_ident()] = context

    def __getattr__(self, name: str) -> FakeFunction:
        if name.startswith("cu"):
            return self._functions.setdefault(name, FakeFunction(self, name))
        raise AttributeError(name)

    def names(self) -> list[str]:
        return [name for name, _, _ in self.calls]


CALLER_STREAM, DMA_STREAM = 0x55, 0x77


def fake_cuda_dma(actor: GpuDmaActor) -> FakeLibrary:
    """Set ``actor`` (made for ``cpu``, on the event loop) up as ``on_start`` does on a GPU,
    on a fake driver whose copies move host bytes; returns the fake's GIL-keeping library.
    ``actor.on_stop()`` ends its completions thread."""
    held, released = FakeLibrary(), FakeLibrary()
    held.move = True
    actor.cuda = True
    actor._driver = CudaDriver(held, released, CONTEXT)
    actor._ready_event = actor._driver.new_event()
    actor._stream = SimpleNamespace(cuda_stream=DMA_STREAM)  # type: ignore[assignment]
    actor._caller_stream = lambda: SimpleNamespace(cuda_stream=CALLER_STREAM)  # type: ignore[method-assign,assignment,return-value]
    actor._call_on_loop = loop_caller()
    actor._completions = DmaCompletions(actor._call_on_loop)
    actor._completions.start()
    return held
