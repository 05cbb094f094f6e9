"""Shared fixtures of the pipeline tests."""

from collections.abc import Iterator

import pytest
import structlog


@pytest.fixture(autouse=True)
def _fresh_structlog() -> Iterator[None]:
    """Undo the CLI's ``structlog.configure`` after each test.

    ``dualblade.cli.main`` points structlog at the ``sys.stderr`` of the moment, which under
    ``capsys`` is a capture stream closed after the test; a later test that logs would then fail
    with "I/O operation on closed file".
    """
    yield
    structlog.reset_defaults()
