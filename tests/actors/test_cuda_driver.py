"""The CUDA driver binding: calls in order, errors named, waits bound to the copy's context.

No GPU here: the library is a fake that records each call and answers with the codes a test
gives it. The copies themselves are checked on the GPU machine (docs/pipeline-profile.md).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import pytest

from dualblade.actors.cuda_driver import CudaDriver, CudaDriverError, DriverEvent, load_driver

from .fake_cuda import CONTEXT, FakeLibrary


def make_driver() -> tuple[CudaDriver, FakeLibrary, FakeLibrary]:
    held, released = FakeLibrary(), FakeLibrary()
    return CudaDriver(held, released, CONTEXT), held, released


def test_a_copy_is_queued_with_the_gil_held_and_waited_for_without_it():
    driver, held, released = make_driver()
    event = driver.new_event()
    driver.record(event, 7)
    driver.wait(8, event)
    driver.copy_to_device(0xD000, 0xA000, 4096, 8)
    driver.copy_to_host(0xA000, 0xD000, 4096, 8)
    assert held.names() == [
        "cuEventCreate",
        "cuEventRecord",
        "cuStreamWaitEvent",
        "cuMemcpyHtoDAsync_v2",
        "cuMemcpyDtoHAsync_v2",
    ]
    assert held.calls[3][2] == (0xD000, 0xA000, 4096, 8)  # device, host, bytes, stream
    assert released.calls == []  # nothing that waits went through the GIL-keeping library
    DriverEvent(driver, event).synchronize()
    assert released.names() == ["cuEventSynchronize"]


def test_a_failed_call_names_itself_and_the_code():
    driver, held, _ = make_driver()
    held.codes["cuMemcpyHtoDAsync_v2"] = 700  # CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(CudaDriverError, match="cuMemcpyHtoDAsync failed: CUDA driver error 700"):
        driver.copy_to_device(1, 2, 3, 4)


def test_query_tells_running_from_finished_and_raises_on_errors():
    driver, held, _ = make_driver()
    assert driver.query(0x10)
    held.codes["cuEventQuery"] = 600  # not ready
    assert not driver.query(0x10)
    held.codes["cuEventQuery"] = 719  # launch failure
    with pytest.raises(CudaDriverError, match="cuEventQuery failed"):
        driver.query(0x10)


def test_each_waiting_thread_makes_the_context_current_once():
    driver, held, released = make_driver()
    event = DriverEvent(driver, 0x10)

    def wait_twice() -> None:
        event.synchronize()
        event.synchronize()

    thread = threading.Thread(target=wait_twice, name="waiter")
    thread.start()
    thread.join()
    sets = [call for call in held.calls if call[0] == "cuCtxSetCurrent"]
    assert len(sets) == 1
    assert sets[0][1] == "waiter"
    assert sets[0][2] == (CONTEXT,)
    assert released.names() == ["cuEventSynchronize", "cuEventSynchronize"]


def test_bind_makes_the_context_current_on_a_thread_that_has_none():
    driver, held, _ = make_driver()
    driver.bind()  # current here already: nothing to set
    assert "cuCtxSetCurrent" not in held.names()
    seen: list[bool] = []

    def on_another_thread() -> None:
        seen.append(driver.is_current())
        driver.bind()
        driver.bind()
        seen.append(driver.is_current())

    thread = threading.Thread(target=on_another_thread, name="engine")
    thread.start()
    thread.join()
    assert seen == [False, True]
    sets = [call for call in held.calls if call[0] == "cuCtxSetCurrent"]
    assert [(thread_name, args) for _, thread_name, args in sets] == [("engine", (CONTEXT,))]


def test_the_driver_is_used_only_while_its_context_is_current():
    driver, held, _ = make_driver()
    assert driver.is_current()
    held.current = 0x6000  # the caller switched devices
    assert not driver.is_current()
    held.current = None
    assert not driver.is_current()


def test_no_driver_without_libcuda_or_a_current_context(monkeypatch: pytest.MonkeyPatch):
    def missing(name: str) -> Any:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "PyDLL", missing)
    assert load_driver() is None

    library = FakeLibrary()
    library.current = None
    monkeypatch.setattr(ctypes, "PyDLL", lambda name: library)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: library)
    assert load_driver() is None
    library.current = CONTEXT
    driver = load_driver()
    assert driver is not None
    assert driver.context == CONTEXT
