"""Our processes' event loop: uvloop's where installed, asyncio's when asked, a clear error for
anything else; the same choice for the loops dualblade starts on a thread of its own."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
from anyio.from_thread import start_blocking_portal

from dualblade import event_loop
from dualblade.errors import ConfigError

HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None


async def running_loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


@pytest.mark.skipif(not HAS_UVLOOP, reason="uvloop is not installed (pip install uvloop)")
def test_our_loop_is_uvloops_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(event_loop.ENV, raising=False)
    assert event_loop.loop_name() == "uvloop"
    assert event_loop.run(running_loop_module).startswith("uvloop")
    with start_blocking_portal("asyncio", event_loop.backend_options()) as portal:
        assert portal.call(running_loop_module).startswith("uvloop")


def test_asyncio_is_asked_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(event_loop.ENV, "asyncio")
    assert event_loop.loop_name() == "asyncio"
    assert event_loop.run(running_loop_module).startswith("asyncio")


def test_another_loop_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(event_loop.ENV, "tokio")
    with pytest.raises(ConfigError, match=r"DUALBLADE_EVENT_LOOP must be .*'tokio'"):
        event_loop.run(running_loop_module)


def test_without_uvloop_the_default_is_asyncio_and_asking_for_it_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    monkeypatch.delenv(event_loop.ENV, raising=False)
    assert event_loop.loop_name() == "asyncio"
    monkeypatch.setenv(event_loop.ENV, "uvloop")
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        event_loop.loop_name()
