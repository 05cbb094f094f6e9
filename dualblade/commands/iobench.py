"""``dualblade iobench``: raw I/O of our direct and page-cache paths, side by side with fio."""

from __future__ import annotations

import argparse
import sys

from dualblade.commands._output import format_table, print_json
from dualblade.errors import ConfigError
from dualblade.pipeline import default_cache_dir


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "iobench",
        help="sequential write + cold read: our direct and page-cache paths vs fio",
        description=(
            "Writes the target sequentially, then reads it back cold (page cache dropped), "
            "through dualblade's direct path and, alternating in the same invocation, through "
            "fio with the same parameters; reports medians and the ratio ours/fio."
        ),
    )
    parser.add_argument(
        "--target",
        default=str(default_cache_dir() / "iobench.dat"),
        help="file (created and preallocated) or raw block device (default: %(default)s)",
    )
    parser.add_argument(
        "--size", default="1GiB", help="bytes to move per run (default: %(default)s)"
    )
    parser.add_argument("--block-size", default="1MiB", help="chunk size (default: %(default)s)")
    parser.add_argument(
        "--queue-depth", type=int, default=32, help="chunks in flight (default: 32)"
    )
    parser.add_argument("--runs", type=int, default=3, help="runs per side (default: 3)")
    parser.add_argument(
        "--request-size",
        default="128MiB",
        help="bytes per request, like one KPU read (default: %(default)s); two are in flight",
    )
    parser.add_argument("--no-fio", action="store_true", help="skip the fio reference")
    parser.add_argument(
        "--no-page-cache", action="store_true", help="skip the page-cache path measurement"
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dualblade.bench import IoBenchConfig, run_iobench
    from dualblade.pipeline import parse_size

    size = parse_size(args.size)
    block_size = parse_size(args.block_size)
    if block_size <= 0 or block_size % 4096:
        raise ConfigError(f"--block-size must be a positive multiple of 4096, got {block_size}")
    if size < block_size:
        raise ConfigError(f"--size ({size}) must be at least one block ({block_size})")
    if parse_size(args.request_size) < block_size:
        raise ConfigError("--request-size must be at least one block")
    if args.queue_depth < 1 or args.runs < 1:
        raise ConfigError("--queue-depth and --runs must be at least 1")
    config = IoBenchConfig(
        path=args.target,
        size=size,
        block_size=block_size,
        queue_depth=args.queue_depth,
        runs=args.runs,
        use_fio=not args.no_fio,
        page_cache=not args.no_page_cache,
        request_bytes=parse_size(args.request_size),
    )
    result = run_iobench(config, progress=lambda line: print(line, file=sys.stderr, flush=True))
    document = result.to_json()
    if args.json:
        print_json(document)
        return 0
    rows = []
    results = document["results"]
    assert isinstance(results, dict)
    for path, ops in results.items():
        for op, summary in ops.items():
            rows.append(
                [
                    f"{path} {op}",
                    f"{summary['median_bytes_per_s'] / 1e6:.0f}",
                    f"{summary['min_bytes_per_s'] / 1e6:.0f}",
                    f"{summary['max_bytes_per_s'] / 1e6:.0f}",
                    summary["runs"],
                ]
            )
    print(
        f"target {config.path}: {size} bytes, block {block_size}, QD {config.queue_depth}, "
        f"engine {document['engine']}"
    )
    print(format_table(["path", "median MB/s", "min", "max", "runs"], rows))
    if "direct_vs_fio" in document:
        print(f"direct vs fio (median ratio): {document['direct_vs_fio']}")
    print(
        f"user CPU per chunk: ours {document['cpu_us_per_chunk']} us, "
        f"fio {document['fio_cpu_us_per_chunk']} us"
    )
    return 0
