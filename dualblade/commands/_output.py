"""Shared output helpers for sub-commands: JSON documents and aligned text tables."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence


def print_json(document: object) -> None:
    """Print a JSON document to stdout (the machine-readable form of every command)."""
    json.dump(document, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain, aligned text table (left-aligned first column, right-aligned others)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for index, row in enumerate(cells):
        parts = [
            cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row)
        ]
        lines.append("  ".join(parts))
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
