"""Fixtures for the NVMe passthrough subset (``pytest -m nvme``).

These tests need a real NVMe namespace's generic char device (``/dev/ngXnY``). Our machines and CI
have none; ``scripts/nvme-vm`` boots a QEMU guest with an emulated controller and runs pytest
there, e.g. ``scripts/nvme-vm --lba-size 512 -- .venv/bin/python -m pytest -m nvme
-p no:cacheprovider tests/nvme``. Elsewhere every test of the subset skips with that hint.
"""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest

_HERE = Path(__file__).parent.resolve()
_NG = re.compile(r"ng(\d+)n(\d+)")
NO_NAMESPACE = "no NVMe namespace (/dev/ngXnY): run inside scripts/nvme-vm"


def _namespaces() -> list[Path]:
    """The /dev/ngXnY char devices, in controller then namespace order (ng2n1 before ng10n1)."""
    found = []
    for path in Path("/dev").glob("ng*n*"):
        m = _NG.fullmatch(path.name)
        try:
            is_chr = stat.S_ISCHR(path.stat().st_mode)
        except OSError:
            continue
        if m and is_chr:
            found.append((int(m.group(1)), int(m.group(2)), path))
    return [path for _, _, path in sorted(found)]


@pytest.fixture(scope="session")
def nvme_namespace_path() -> Path:
    """Path of the first NVMe namespace char device (/dev/ngXnY); skips when there is none."""
    found = _namespaces()
    if not found:
        pytest.skip(NO_NAMESPACE)
    return found[0]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test under tests/nvme with ``nvme``, before ``-m`` selection looks at marks."""
    for item in items:
        if _HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.nvme)
