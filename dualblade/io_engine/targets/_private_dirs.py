"""Folders for KV files, created owner-only: the files hold users' prompts in another form."""

from __future__ import annotations

import os
from pathlib import Path


def make_private_dirs(folder: Path) -> None:
    """Create ``folder`` and each missing parent with mode 0700; existing folders are left as
    they are (they are the user's). ``Path.mkdir(parents=True)`` gives parents the umask's mode.
    """
    missing: list[Path] = []
    current = folder
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # made meanwhile by another store: fine if it is a folder
            if not path.is_dir():
                raise
