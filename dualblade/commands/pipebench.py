"""``dualblade pipebench``: actor pipeline vs raw engine throughput on the same direct bytes."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dualblade import event_loop
from dualblade.commands._output import print_json
from dualblade.errors import ConfigError


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "pipebench",
        help="pure-direct decode reads: the actor pipeline vs the raw engine on the same bytes",
    )
    parser.add_argument("config", nargs="?", help="pipeline config; default: embedded")
    parser.add_argument("--runs", type=int, default=5, help="runs per side (default 5)")
    parser.add_argument("--passes", type=int, default=8, help="reads of the whole cache per run")
    parser.add_argument("--device", default="cpu", help="where reads land (cpu, cuda)")
    parser.add_argument(
        "--path",
        choices=("direct", "page-cache"),
        default="direct",
        help="direct (default): every layer direct, against the raw engine and fio; page-cache: "
        "every layer in the page cache, resident, against the machine's limit for moving those "
        "files to the device (plain threads with preadv and their own streams)",
    )
    parser.add_argument(
        "--target",
        help="a file to use as the direct target instead of the config's (e.g. one in /dev/shm, "
        "to see what the pipeline costs rather than what the disk allows)",
    )
    parser.add_argument("--no-fio", action="store_true", help="skip fio's read of the same extents")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dualblade.bench import run_pipebench
    from dualblade.commands.run import load_run_config

    if args.runs < 1 or args.passes < 1:
        raise ConfigError("--runs and --passes must be at least 1")
    config = load_run_config(args.config, None)
    if args.path == "page-cache":
        return _page_cache(args, config)
    result = event_loop.run(
        lambda: run_pipebench(
            config,
            runs=args.runs,
            passes=args.passes,
            device=args.device,
            target=args.target,
            use_fio=not args.no_fio,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    )
    document = result.to_json()
    if args.json:
        print_json(document)
    else:
        print(
            f"pipeline {document['pipeline_median_bytes_per_s'] / 1e6:.1f} MB/s, raw engine "
            f"{document['raw_median_bytes_per_s'] / 1e6:.1f} MB/s (medians of {args.runs}); "
            f"ratio {document['ratio']}; CPU s/GB: pipeline "
            f"{document['pipeline_cpu_s_per_gb']}, raw {document['raw_cpu_s_per_gb']}"
        )
        if "raw_host_median_bytes_per_s" in document:
            print(
                f"raw engine's reads alone (to pinned memory) "
                f"{document['raw_host_median_bytes_per_s'] / 1e6:.1f} MB/s; pipeline / them "
                f"{document['ratio_vs_raw_host']}"
            )
        if "raw_vs_fio" in document:
            print(
                f"fio on the same extents {document['fio_median_bytes_per_s'] / 1e6:.1f} MB/s; "
                f"raw engine's reads / fio {document['raw_vs_fio']}"
            )
        else:
            print(f"fio not run: {document['fio_note']}")
    return 0


def _page_cache(args: argparse.Namespace, config: Any) -> int:
    from dualblade.bench import run_page_cache_pipebench

    if args.target is not None:
        raise ConfigError("--target names a direct target: it does not apply to --path page-cache")
    result = event_loop.run(
        lambda: run_page_cache_pipebench(
            config,
            runs=args.runs,
            passes=args.passes,
            device=args.device,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    )
    document = result.to_json()
    if args.json:
        print_json(document)
    else:
        print(
            f"page-cache path {document['pipeline_median_bytes_per_s'] / 1e6:.1f} MB/s, machine "
            f"limit {document['limit_median_bytes_per_s'] / 1e6:.1f} MB/s (medians of "
            f"{args.runs}; best thread counts {document['limit_threads']}); ratio "
            f"{document['ratio']}; resident after: {document['resident_fraction']:.0%}"
        )
    return 0
