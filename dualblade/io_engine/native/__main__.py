"""``python -m dualblade.io_engine.native``: build the chunk pump's library (scripts/bootstrap).

Exits 0 with a warning on stderr when no compiler is there: the ring then keeps its Python path.
``--require`` makes that an error (exit 1).
"""

from __future__ import annotations

import sys

from dualblade.io_engine.native import NativeBuildError, build


def main(argv: list[str]) -> int:
    try:
        path = build()
    except NativeBuildError as error:
        print(f"dualblade: the chunk pump was not built: {error}", file=sys.stderr)
        return 1 if "--require" in argv else 0
    print(f"dualblade: built {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
