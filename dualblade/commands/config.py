"""``dualblade config``: validate a pipeline config, or print the JSON Schema that editors use.

``dualblade config check FILE`` reads the file exactly as every other command does (environment
overrides included), so a config that passes here loads everywhere; a bad one gets the same
one-paragraph message and exit status 2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dualblade.pipeline import config_json_schema, load_config


def register(subparsers: Any) -> None:
    """Add ``config schema`` and ``config check``."""
    parser = subparsers.add_parser(
        "config",
        help="validate a pipeline config or print its JSON Schema",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="config_action", metavar="ACTION", required=True)
    schema = actions.add_parser("schema", help="print the JSON Schema of a pipeline config")
    schema.set_defaults(func=_schema)
    check = actions.add_parser("check", help="validate a config file (.toml, .yaml, .yml)")
    check.add_argument("file", type=Path, help="the config file")
    check.add_argument(
        "--show", action="store_true", help="print the resolved config (defaults filled) as JSON"
    )
    check.set_defaults(func=_check)


def _schema(args: argparse.Namespace) -> int:
    print(json.dumps(config_json_schema(), indent=2))
    return 0


def _check(args: argparse.Namespace) -> int:
    config = load_config(args.file)
    if args.show:
        print(json.dumps(config.model_dump(mode="json"), indent=2))
        return 0
    shape, workload = config.shape(), config.workload
    print(
        f"{args.file}: valid — {shape.name} ({shape.num_layers} layers, {shape.num_kv_heads} KV "
        f"heads × {shape.head_dim}, {shape.dtype}), batch {workload.batch}, "
        f"{workload.prompt_len} + {workload.max_new_tokens} tokens, policy {config.policy}, "
        f"direct target {config.storage.direct.kind} {config.storage.direct.path}"
    )
    return 0
