"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
from collections.abc import Iterator

import hypothesis.internal.conjecture.optimiser  # noqa: F401  (see below)
import pytest
import structlog

# Hypothesis imports its optimiser lazily, in the middle of a property test, and pytest rewrites
# the module's asserts as it loads. Compiling it that deep in the stack on CPython 3.11.7 failed
# now and then with "SystemError: AST constructor recursion depth mismatch" (CPython gh-106905,
# pytest-dev/pytest#10763). Imported here, it compiles at the top of the stack, once.


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every ``@pytest.mark.anyio`` test under both asyncio and trio."""
    return str(request.param)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``root``-marked tests, with the reason, when not running as root."""
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root (loop devices, cgroups, drop_caches); run as root")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    """Undo a test's ``structlog.configure`` (the CLI's): its stream is pytest's, closed later."""
    yield
    structlog.reset_defaults()
