"""The house rules a linter does not check: small modules, and doors between rooms.

The import-linter contract in pyproject.toml (``lint-imports``, run by .ci/run) checks which
rooms may import which. These tests check the rest of docs/architecture.md: no module is over
400 lines, and code outside a subpackage imports that subpackage's public names from its
``__init__``, never from its modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dualblade"
MAX_LINES = 400
SOURCES = sorted(PACKAGE.rglob("*.py"))


def _room(path: Path) -> str | None:
    """The subpackage a module belongs to (None for top-level modules such as cli.py)."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else None


def _subpackages() -> set[str]:
    return {p.parent.name for p in PACKAGE.glob("*/__init__.py")}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_is_over_400_lines(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines: split it by idea"


def test_code_outside_a_room_enters_by_its_front_door() -> None:
    rooms = _subpackages()
    examples = sorted((PACKAGE.parent / "examples").glob("*.py"))
    side_doors = []
    for path in [*SOURCES, *examples]:
        inside = _room(path) if path.is_relative_to(PACKAGE) else None
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            parts = node.module.split(".")
            room = parts[1] if parts[0] == "dualblade" and len(parts) > 2 else None
            if room in rooms and room != inside:
                side_doors.append(f"{path.name}:{node.lineno} from {node.module}")
    assert not side_doors, "import these from the subpackage itself:\n" + "\n".join(side_doors)


def test_the_plan_is_pure() -> None:
    """pipeline imports no torch and nothing that runs (lint-imports checks the rooms)."""
    for path in (PACKAGE / "pipeline").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n.split(".")[0] == "torch" for n in names), path.name
