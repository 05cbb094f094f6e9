"""``dualblade run [CONFIG]``: the main job — a KV workload through the whole pipeline.

Without a config it runs the embedded default: a small OPT-shaped synthetic workload (prefill,
then decode steps of KV traffic) on a DirectFile under the user's cache dir with the discovered
memory budget, and prints prefill and decode latency, the path split, the page-cache hit rate and
the locked overlap strategy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dualblade import event_loop
from dualblade.commands._output import format_table, print_json
from dualblade.commands._progress import ProgressBar


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "run", help="run a KV workload (prefill + decode) through the pipeline"
    )
    parser.add_argument("config", nargs="?", help="pipeline config (TOML/YAML); default: embedded")
    parser.add_argument("--policy", help="override the config's policy")
    parser.add_argument("--memory-limit", help="plan against this memory limit, e.g. 2GiB")
    parser.add_argument("--steps", type=int, help="decode steps (default: max_new_tokens)")
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda if available)")
    parser.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace here")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)


def load_run_config(path: str | None, policy: str | None) -> Any:
    """The config to run: the file given, or the embedded default; ``policy`` overrides."""
    from dualblade.pipeline import config_from_mapping, load_config, load_default_config

    config = load_default_config() if path is None else load_config(path)
    if policy is not None:
        data = config.model_dump()
        data["policy"] = policy
        config = config_from_mapping(data, source="--policy", env={})
    return config


def run(args: argparse.Namespace) -> int:
    from dualblade.bench import run_kv_workload, summarize
    from dualblade.pipeline import parse_size
    from dualblade.store import open_store
    from dualblade.telemetry import Tracer

    config = load_run_config(args.config, args.policy)
    memory_limit = parse_size(args.memory_limit) if args.memory_limit else None
    tracer = Tracer(enabled=args.trace is not None or config.telemetry.trace_file is not None)
    trace_path = args.trace or config.telemetry.trace_file
    progress = ProgressBar()

    async def main() -> dict[str, Any]:
        async with open_store(
            config, device=args.device, tracer=tracer, memory_limit=memory_limit
        ) as store:
            result = await run_kv_workload(store, decode_steps=args.steps, progress=progress)
            report = summarize(store, result)
            report["budget"] = store.plan.budget.to_dict()
        return report

    report = event_loop.run(main)
    if trace_path is not None:
        tracer.write(trace_path)
        report["trace"] = str(trace_path)
    if args.json:
        print_json(report)
        return 0
    _print_report(report)
    return 0


def _print_report(report: dict[str, Any]) -> None:
    split = report["path_split"]
    hit = report["page_cache_hit_rate"]
    rows = [
        ["policy", report["policy"]],
        ["device", report["device"]],
        ["prefill", f"{report['prefill_s'] * 1e3:.1f} ms"],
        [
            "decode (total)",
            f"{report['decode_s'] * 1e3:.1f} ms over {len(report['decode_step_s'])} steps",
        ],
        ["page-cache layers", _ranges(split["page_cache_layers"])],
        ["direct layers", _ranges(split["direct_layers"])],
        ["page-cache budget", f"{report['page_cache_budget_bytes'] / 2**20:.1f} MiB"],
        ["page-cache hit rate", "n/a" if hit is None else f"{hit:.1%}"],
        ["strategy (locked)", report["strategy"]],
        ["bytes verified", f"{report['verified_bytes'] / 2**20:.1f} MiB"],
    ]
    if "trace" in report:
        rows.append(["trace", report["trace"]])
    print(format_table(["", ""], rows).split("\n", 2)[2], file=sys.stdout)


def _ranges(layers: list[int]) -> str:
    if not layers:
        return "none"
    out, start, prev = [], layers[0], layers[0]
    for layer in [*layers[1:], None]:
        if layer is not None and layer == prev + 1:
            prev = layer
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if layer is not None:
            start = prev = layer
    return ", ".join(out)
