"""Compat mode: on, off and auto, and the automatic fallback when io_uring is unavailable."""

from __future__ import annotations

import os

import pytest
from structlog.testing import capture_logs

from dualblade.io_engine import (
    AlignedBuffer,
    DirectFile,
    IOEngine,
    IOEngineError,
    IoUringUnavailableError,
)
from dualblade.io_engine import _backend as backend_module
from dualblade.io_engine.targets.nvme_namespace import NvmeNamespace


def _unavailable(*args: object, **kwargs: object) -> None:
    raise IoUringUnavailableError("io_uring is disabled by the sysctl kernel.io_uring_disabled=2")


@pytest.fixture
def no_io_uring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend_module, "Ring", _unavailable)
    monkeypatch.setattr(backend_module, "_warned_fallback", False)


@pytest.mark.usefixtures("no_io_uring")
def test_auto_falls_back_and_logs_why_once(tmp_path: os.PathLike[str]) -> None:
    with capture_logs() as logs:
        first = IOEngine(compat="auto")
        second = IOEngine(compat="auto")
    try:
        assert first.kind == second.kind == "threadpool"
        assert first.fallback_reason is not None
        assert "io_uring_disabled" in first.fallback_reason
        warnings = [e for e in logs if e["log_level"] == "warning"]
        assert len(warnings) == 1
        assert "io_uring_disabled" in warnings[0]["reason"]
        with (
            DirectFile(os.path.join(tmp_path, "f.dat"), 1 << 20) as target,
            AlignedBuffer(1 << 20) as buf,
        ):
            buf.view[:] = b"\x42" * buf.size
            first.write(target, buf, 1 << 20, 0)
            buf.view[:] = bytes(buf.size)
            first.read(target, buf, 1 << 20, 0)
            assert bytes(buf.view) == b"\x42" * buf.size
    finally:
        first.close()
        second.close()


@pytest.mark.usefixtures("no_io_uring")
def test_off_raises_the_reason() -> None:
    with pytest.raises(IoUringUnavailableError, match="io_uring_disabled"):
        IOEngine(compat="off")


@pytest.mark.usefixtures("no_io_uring")
def test_passthrough_never_falls_back() -> None:
    with pytest.raises(IoUringUnavailableError):
        IOEngine(compat="auto", passthrough=True)
    with pytest.raises(IOEngineError, match="passthrough needs io_uring"):
        IOEngine(compat="on", passthrough=True)


def test_environment_selects_compat(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUALBLADE_COMPAT", "on")
    with IOEngine() as eng:
        assert eng.kind == "threadpool"


def test_threadpool_refuses_passthrough_targets() -> None:
    namespace = object.__new__(NvmeNamespace)
    namespace.name = "/dev/ng0n1"
    with IOEngine(compat="on") as eng, AlignedBuffer(4096) as buf:
        namespace.size, namespace.lba_size, namespace.alignment, namespace.max_transfer = (
            1 << 20,
            512,
            4096,
            4096,
        )
        with pytest.raises(IOEngineError, match="passthrough=True"):
            eng.read(namespace, buf, 4096, 0)


def test_nvme_namespace_refuses_other_devices() -> None:
    from dualblade.io_engine import TargetError

    with pytest.raises(TargetError, match="not an NVMe generic char device"):
        NvmeNamespace("/dev/null")
