"""Which backend moves the engine's chunks: the io_uring ring, or the thread pool when io_uring
cannot be set up (compat mode, see :mod:`dualblade.io_engine.engine`)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

from dualblade.io_engine._request import IORequest
from dualblade.io_engine._threadpool import ThreadPoolBackend
from dualblade.io_engine.buffers import AlignedBuffer
from dualblade.io_engine.errors import IOEngineError, IoUringUnavailableError
from dualblade.io_engine.ring import Ring
from dualblade.logs import get_logger

_log = get_logger(__name__)
_warned_fallback = False
_warn_lock = threading.Lock()


class Backend(Protocol):
    """What the engine needs from the ring or the thread pool."""

    queue_depth: int
    chunks_submitted: int

    @property
    def peak_inflight(self) -> int: ...

    @property
    def inflight(self) -> int: ...

    def submit(self, request: IORequest) -> None: ...
    def cancel(self, request: IORequest) -> None: ...
    def register_buffers(self, buffers: Sequence[AlignedBuffer]) -> None: ...
    def add_fixed_buffer(self, buffer: AlignedBuffer) -> str | None: ...
    def remove_fixed_buffer(self, buffer: AlignedBuffer) -> None: ...
    def buffer_index(self, buffer: AlignedBuffer) -> int | None: ...
    def close(self) -> None: ...


def _warn_fallback_once(reason: str) -> None:
    global _warned_fallback
    with _warn_lock:
        if _warned_fallback:
            return
        _warned_fallback = True
    _log.warning("io_uring unavailable; using the thread-pool compatibility engine", reason=reason)


def open_backend(
    mode: str, queue_depth: int, *, passthrough: bool, name: str
) -> tuple[Backend, str | None]:
    """The backend for compat ``mode`` and why it is the thread pool (None for the ring).

    Raises:
        IOEngineError: compat ``on`` with passthrough.
        IoUringUnavailableError: io_uring cannot be used and ``mode`` or passthrough forbid
            the thread pool.
    """
    if mode == "on":
        if passthrough:
            raise IOEngineError("NVMe passthrough needs io_uring; compat mode 'on' forbids it")
        return ThreadPoolBackend(queue_depth, name=name), "compat mode 'on'"
    try:
        return Ring(queue_depth, passthrough=passthrough, name=name), None
    except IoUringUnavailableError as error:
        if mode == "off" or passthrough:
            raise
        _warn_fallback_once(str(error))
        return ThreadPoolBackend(queue_depth, name=name), str(error)
