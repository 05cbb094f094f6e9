"""Which liburing calls keep the GIL: the ring thread must not let the GIL go on calls that
never wait, or it waits for the event loop's switch interval to get it back after each one."""

from __future__ import annotations

import ctypes

import pytest

from dualblade.io_engine import IoUringUnavailableError, _liburing

#: ctypes marks a function bound through PyDLL (called with the GIL held) with this flag.
_KEEPS_GIL = getattr(ctypes, "_FUNCFLAG_PYTHONAPI", 4)


def _lib() -> _liburing.LibUring:
    try:
        return _liburing.load()
    except IoUringUnavailableError as error:
        pytest.skip(f"no liburing FFI library here: {error}")


@pytest.mark.parametrize(
    "name",
    [
        "io_uring_get_sqe",
        "io_uring_submit",
        "io_uring_peek_batch_cqe",
        "io_uring_cq_advance",
        "io_uring_prep_read_fixed",
        "io_uring_sqe_set_data64",
    ],
)
def test_calls_that_never_wait_keep_the_gil(name: str) -> None:
    assert getattr(_lib(), name)._flags_ & _KEEPS_GIL


@pytest.mark.parametrize(
    "name", ["io_uring_submit_and_wait", "io_uring_queue_init_params", "io_uring_register_buffers"]
)
def test_calls_that_may_wait_release_the_gil(name: str) -> None:
    assert not getattr(_lib(), name)._flags_ & _KEEPS_GIL


def test_every_call_kept_under_the_gil_is_bound() -> None:
    lib = _lib()
    for name in _liburing._KEEP_GIL:
        assert getattr(lib, name)._flags_ & _KEEPS_GIL, name
