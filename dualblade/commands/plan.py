"""``dualblade plan CONFIG``: show what a pipeline would put where, without moving a byte.

Prints the page-cache budget with its derivation, Algorithm 1's two groups of layers and the
bytes of each, and the LBA extent of every direct KPU; ``--json`` prints the same as one JSON
object (``budget``, ``groups``, ``placement``, ``model``, ``workload``, ``layout``, ``target``,
``extents``). ``--memory-limit`` plans for that limit instead of the one discovered here;
``--device cuda`` plans as a CUDA store budgets: its copy threads' pinned buffers hold one or two
KPU images and room for appended rows, and the budget reserves them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dualblade.pipeline import Plan, budget_for, format_size, load_config, make_plan, parse_size


def register(subparsers: Any) -> None:
    """Add ``plan``."""
    parser = subparsers.add_parser(
        "plan",
        help="show the budget, the layer groups and the LBA extents of a config",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", type=Path, help="pipeline config (.toml, .yaml, .yml)")
    parser.add_argument(
        "--memory-limit",
        metavar="SIZE",
        help="plan for this memory limit (e.g. 6GiB) instead of the discovered one",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="plan as a store on this device type budgets its pinned buffers (default: cpu)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load, budget, plan, print."""
    config = load_config(args.config)
    limit = None if args.memory_limit is None else parse_size(args.memory_limit)
    if args.device == "cuda":
        # the store's own layout; the store loads torch, so it is imported only where asked
        from dualblade.store import pin_layout_for

        pinned = pin_layout_for(config, args.device, limit)
        budget = budget_for(config, limit, pin_images=pinned.images, row_room=pinned.row_room)
    else:  # a host store: one image, no room for rows
        budget = budget_for(config, limit)
    plan = make_plan(config, budget)
    text = _compact_json(plan.to_dict()) if args.json else render_table(plan, str(args.config))
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # `dualblade plan ... | head` closed the pipe: that reader wanted no more, which is not an
        # error. Point stdout at /dev/null so the interpreter's final flush stays quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _compact_json(value: Any, indent: int = 0) -> str:
    """Indented JSON, but flat lists and the flat records inside lists take one line each.

    Layer lists and extent records are long columns of short items; one line each keeps
    ``dualblade plan --json`` readable in a terminal while staying ordinary JSON.
    """
    pad, inner = "  " * indent, "  " * (indent + 1)
    if isinstance(value, dict) and value:
        items = [
            f"{inner}{json.dumps(k)}: {_compact_json(v, indent + 1)}" for k, v in value.items()
        ]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, list) and value and not all(_flat(item) for item in value):
        items = [
            f"{inner}{_one_line(item) if _flat_record(item) else _compact_json(item, indent + 1)}"
            for item in value
        ]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return _one_line(value)


def _flat(value: Any) -> bool:
    return not isinstance(value, dict | list)


def _flat_record(value: Any) -> bool:
    return isinstance(value, dict) and all(_flat(item) for item in value.values())


def _one_line(value: Any) -> str:
    return json.dumps(value, separators=(", ", ": "))


def layer_ranges(layers: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``"0-2, 5, 7-8"``; ``"none"`` when empty."""
    if not layers:
        return "none"
    runs: list[str] = []
    start = prev = layers[0]
    for layer in [*layers[1:], None]:
        if layer is not None and layer == prev + 1:
            prev = layer
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if layer is not None:
            start = prev = layer
    return ", ".join(runs)


def render_table(plan: Plan, source: str) -> str:
    """The plan for people."""
    shape, workload, layout = plan.shape, plan.config.workload, plan.layout
    placement, target = plan.placement, plan.config.storage.direct
    kpu = shape.kpu_bytes(workload.batch, workload.max_len)
    lines = [
        f"plan for {source}: {shape.name}, batch {workload.batch}, "
        f"{workload.prompt_len} + {workload.max_new_tokens} tokens, policy {placement.policy}",
        f"KPU {format_size(kpu)} (row {format_size(layout.row_bytes)}, stride "
        f"{format_size(layout.row_stride)}, padding {layout.padding_overhead:.1%}), "
        f"layer K+V {format_size(2 * kpu)}, all layers "
        f"{format_size(shape.total_kv_bytes(workload.batch, workload.max_len))}",
        "",
        "budget",
    ]
    for term in plan.budget.terms():
        lines.append(f"  {term.name:<28} {format_size(term.nbytes):>12}  {term.note}".rstrip())
    lines += [
        "",
        f"groups (n1 = {placement.n1}, page-cache layers {plan.config.page_cache_layers})",
        f"  {'page cache':<12} {len(placement.page_cache):>3} layers  "
        f"{format_size(placement.page_cache_bytes):>12}  {layer_ranges(placement.page_cache)}",
        f"  {'direct':<12} {len(placement.direct):>3} layers  "
        f"{format_size(placement.direct_bytes):>12}  {layer_ranges(placement.direct)}",
        "",
        f"extents on {target.kind} {target.path} (LBA size {target.lba_size}, region "
        f"{plan.lba_map.region.first_lba} + {plan.lba_map.region.n_blocks} blocks, "
        f"{plan.lba_map.used_blocks} used)",
    ]
    if not len(plan.lba_map):
        lines.append("  none: every layer takes the page-cache path")
    else:
        lines.append(f"  {'KPU':<7} {'lba_start':>12} {'n_blocks':>10} {'size':>12}")
        for extent in plan.lba_map:
            lines.append(
                f"  {extent.kpu!s:<7} {extent.lba_start:>12} {extent.n_blocks:>10} "
                f"{format_size(extent.nbytes):>12}"
            )
    return "\n".join(lines)
