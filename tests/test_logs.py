"""The library stays quiet on stdout until the application configures structlog."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog
from structlog.testing import capture_logs

from dualblade.logs import get_logger


@pytest.fixture(autouse=True)
def _unconfigured() -> Iterator[None]:
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


def test_unconfigured_only_warnings_reach_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert not structlog.is_configured()
    log = get_logger("dualblade.test")
    log.debug("context released", context=1)
    log.info("budget changed", new=5)
    log.warning("cgroup unreadable", path="/x")
    bound = log.bind(store="store-1")
    bound.debug("quiet too")
    captured = capsys.readouterr()
    assert captured.out == ""  # an embedding application's stdout is its own
    assert "cgroup unreadable" in captured.err
    assert "context released" not in captured.err
    assert "budget changed" not in captured.err
    assert "quiet too" not in captured.err


def test_the_applications_configuration_applies_once_made() -> None:
    log = get_logger("dualblade.test")  # made before the application configures structlog
    with capture_logs() as events:
        log.debug("context released", context=1)
        log.bind(store="store-1").info("budget changed")
    assert [e["event"] for e in events] == ["context released", "budget changed"]
    assert events[1]["store"] == "store-1"
