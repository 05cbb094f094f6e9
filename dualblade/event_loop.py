"""Which event loop dualblade's own processes run on: uvloop's where it is installed.

The actors' messages, the ring's and the GPU copies' wake-ups and every task step run on the
event loop's thread, so its own cost is paid per KPU. On the H200 machine a third of the loop's
GIL samples were asyncio's task stepping and its ``_run_once`` (docs/pipeline-profile.md).
uvloop (libuv under asyncio's interface, kept by the MagicStack team and the default of uvicorn)
runs the same coroutines with that part in C. There, over six alternated pairs of pipebench's
CUDA side in two calls, the pipeline reached a median 0.90 of the raw engine under uvloop
against 0.82 under asyncio's loop, with less CPU per GB in all six pairs.

This decides the loop of the commands, the bench's worker processes and the loops dualblade
starts on a thread of its own (``open_store_blocking``, the LMCache adapter). An application
that embeds a store in its own loop runs it there (uvicorn picks uvloop where installed too).
``DUALBLADE_EVENT_LOOP=asyncio`` runs ours on asyncio's own loop, for a comparison or a debugger
that needs it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, TypeVarTuple, Unpack

import anyio

from dualblade.errors import ConfigError

_T = TypeVar("_T")
_Args = TypeVarTuple("_Args")

#: The environment variable that picks the loop: ``uvloop`` (the default where installed) or
#: ``asyncio``.
ENV = "DUALBLADE_EVENT_LOOP"


def loop_name() -> str:
    """``uvloop`` or ``asyncio``: what :func:`run` runs on, from ``$DUALBLADE_EVENT_LOOP``.

    Raises:
        ConfigError: the variable names another loop, or uvloop where it is not installed.
    """
    asked = os.environ.get(ENV, "").strip().lower()
    installed = importlib.util.find_spec("uvloop") is not None
    if asked in ("", "uvloop"):
        if installed:
            return "uvloop"
        if asked:
            raise ConfigError(f"{ENV}=uvloop, but uvloop is not installed (pip install uvloop)")
        return "asyncio"
    if asked == "asyncio":
        return "asyncio"
    raise ConfigError(f"{ENV} must be 'uvloop' or 'asyncio', not {asked!r}")


def backend_options() -> dict[str, Any]:
    """anyio's ``backend_options`` for its asyncio backend, on the loop :func:`loop_name`
    picks (``anyio.run``, ``start_blocking_portal``)."""
    return {"use_uvloop": loop_name() == "uvloop"}


def run(function: Callable[[Unpack[_Args]], Awaitable[_T]], *args: *_Args) -> _T:
    """``anyio.run(function, *args)`` on the loop :func:`loop_name` picks."""
    return anyio.run(function, *args, backend="asyncio", backend_options=backend_options())
