"""A store killed mid-decode, for test_reclaim_kill.py: ``python _crash_child.py CONFIG READY``.

It writes every layer with a recognizable bit pattern (:data:`PATTERN`), then decodes (appends
and reads every layer) until it is killed; it writes ``READY`` once decode is under way.
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import torch

from dualblade.pipeline import PipelineConfig
from dualblade.store import open_store

#: Every 16-bit word the dead store wrote.
PATTERN = 0x5A5A


def pattern_rows(rows: int, batch: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((rows, batch, width), PATTERN, dtype=torch.int16).view(dtype)


async def main(config_path: Path, ready: Path) -> None:
    config = PipelineConfig.model_validate_json(config_path.read_text())
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        rows = pattern_rows(config.workload.prompt_len, ctx.batch, ctx.width, ctx.dtype)
        for layer in range(ctx.num_layers):
            await ctx.write(layer, rows, rows)
        step = 0
        while True:  # decode until killed; once every layer is full, keep reading
            for layer in range(ctx.num_layers):
                if ctx.length(layer) < ctx.max_len:
                    await ctx.append(layer, rows[0], rows[0])
                await ctx.read(layer)
            step += 1
            if step == 2:
                ready.write_text("decoding")


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]), Path(sys.argv[2]))
