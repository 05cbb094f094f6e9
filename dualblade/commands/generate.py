"""``dualblade generate``: real OPT inference with its KV cache offloaded through the pipeline.

A preset with deterministic random weights (no model hub here) or a local checkpoint runs greedy
decoding over a batch of prompts — random ids from ``--seed``, or ``--prompt`` text with a local
``--tokenizer`` — with the KV cache under one policy: the store's (``dual``, ``direct``,
``page-cache``, ``cache-policy``, ``baseline``) or ``memory``, plain tensors in RAM. Every policy
must print the same token ids; the reference is ``memory``.

The storage, memory and copy-thread settings come from ``--config`` (default: the embedded
pipeline); the model's shape and the batch, prompt and generation lengths replace its model and
workload sections. Without ``--preset``/``--model``/``--batch``/... the embedded default's values
are used, so ``dualblade generate`` alone runs OPT-125m shapes on the default pipeline.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dualblade import event_loop
from dualblade.collector import freeze_setup
from dualblade.commands._output import format_table, print_json
from dualblade.errors import ConfigError

_POLICIES = ("dual", "direct", "page-cache", "cache-policy", "baseline", "memory")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "generate", help="greedy OPT generation with the KV cache offloaded (or in memory)"
    )
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--preset", help="OPT preset with random weights (default: the config's)")
    model.add_argument("--model", help="local checkpoint: HF folder or .safetensors file")
    parser.add_argument(
        "--arch", help="OPT preset giving the architecture of a bare .safetensors --model"
    )
    parser.add_argument("--batch", type=int, help="sequences (default: the config's batch)")
    parser.add_argument("--prompt-len", type=int, help="prompt tokens (default: the config's)")
    parser.add_argument("--gen-len", type=int, help="tokens to generate (default: the config's)")
    parser.add_argument("--policy", choices=_POLICIES, help="KV policy (default: the config's)")
    parser.add_argument("--memory-limit", help="plan against this memory limit, e.g. 2GiB")
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda if available)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and prompts")
    parser.add_argument(
        "--compute-dtype",
        default="float32",
        choices=("float32", "float16", "bfloat16"),
        help="dtype of weights and activations (the KV cache keeps the model's dtype)",
    )
    parser.add_argument("--config", help="pipeline config (TOML/YAML); default: embedded")
    parser.add_argument("--tokenizer", type=Path, help="local tokenizer.json (or its folder)")
    parser.add_argument("--prompt", help="prompt text (needs --tokenizer); repeated per sequence")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--trace",
        type=Path,
        help="write a Chrome/Perfetto trace here: the engine's steps and layers beside the "
        "store's actors",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = generate_report(args)
    if args.json:
        print_json(report)
    else:
        _print_report(report)
    return 0


def generate_report(args: argparse.Namespace) -> dict[str, Any]:
    """Run the generation ``args`` describe and return the report ``--json`` prints.

    Raises:
        ConfigError: a bad length, preset, path, policy or tokenizer; a config that is invalid.
    """
    import torch

    from dualblade.commands.run import load_run_config
    from dualblade.models import (
        build_model,
        compute_dtype,
        open_kv,
        random_prompts,
        store_config,
    )
    from dualblade.pipeline import parse_size
    from dualblade.telemetry import Tracer

    base = load_run_config(args.config, None)
    workload = base.workload
    batch = workload.batch if args.batch is None else args.batch
    gen_len = workload.max_new_tokens if args.gen_len is None else args.gen_len
    policy = args.policy or base.policy
    if gen_len < 1:
        raise ConfigError(f"--gen-len must be at least 1, got {gen_len}")
    if batch < 1:
        raise ConfigError(f"--batch must be at least 1, got {batch}")
    if args.prompt is not None and args.tokenizer is None:
        raise ConfigError("--prompt needs --tokenizer to turn the text into token ids")
    if args.model is not None:
        preset = args.arch
    elif args.arch is not None:
        raise ConfigError("--arch describes a --model file; with a preset use --preset alone")
    else:
        preset = args.preset or base.model.preset
    device = _device(args.device)
    memory_limit = parse_size(args.memory_limit) if args.memory_limit else None
    tokenizer = _load_tokenizer(args.tokenizer) if args.tokenizer is not None else None
    if args.trace is not None and args.trace.is_dir():
        raise ConfigError(f"--trace {args.trace} is a folder: name the trace file to write")

    model = build_model(
        preset=preset,
        model_path=args.model,
        seed=args.seed,
        device=device,
        dtype=compute_dtype(args.compute_dtype),
    )
    if args.prompt is not None:
        assert tokenizer is not None
        one = torch.tensor(tokenizer.encode(args.prompt).ids, dtype=torch.int64)
        prompts = one.expand(batch, -1).contiguous()
    else:
        prompt_len = workload.prompt_len if args.prompt_len is None else args.prompt_len
        prompts = random_prompts(batch, prompt_len, model.arch.vocab_size, args.seed)
    model.check_request(prompts, gen_len)
    config = store_config(
        base,
        model.arch,
        batch=batch,
        prompt_len=prompts.shape[1],
        gen_len=gen_len,
        policy=policy,
    )

    tracer = Tracer(enabled=args.trace is not None)
    model.tracer = tracer

    async def main() -> dict[str, Any]:
        async with open_kv(
            config, policy, device=device, memory_limit=memory_limit, tracer=tracer
        ) as kv:
            freeze_setup()  # the model and the store live as long as this command
            result = await model.generate(prompts, gen_len, kv)
            metrics = kv.metrics()
            plan = getattr(kv, "plan", None)
        decode_tokens = batch * (gen_len - 1)
        report: dict[str, Any] = {
            "model": model.arch.name,
            "policy": policy,
            "device": str(device),
            "batch": batch,
            "prompt_len": prompts.shape[1],
            "gen_len": gen_len,
            "seed": args.seed,
            "token_ids": result.tokens.tolist(),
            "prefill_s": round(result.prefill_s, 6),
            "decode_s": round(result.decode_s, 6),
            "decode_step_s": [round(s, 6) for s in result.decode_step_s],
            "tokens_per_s": round(result.tokens_per_s, 2),
            "decode_tokens_per_s": round(decode_tokens / result.decode_s, 2)
            if result.decode_s
            else None,
        }
        if plan is not None:
            placement = plan.placement
            report["path_split"] = {
                "page_cache_layers": list(placement.page_cache),
                "direct_layers": list(placement.direct),
                "page_cache_bytes": placement.page_cache_bytes,
                "direct_bytes": placement.direct_bytes,
            }
            report["read_bytes"] = metrics["read_bytes"]
            report["write_bytes"] = metrics["write_bytes"]
            report["page_cache_hit_rate"] = metrics["page_cache_hit_rate"]
            report["strategy"] = metrics["strategy"]
        else:
            report["path_split"] = {"memory_layers": list(range(model.arch.num_layers))}
        return report

    report = event_loop.run(main)
    if args.trace is not None:
        try:
            tracer.write(args.trace)
        except OSError as error:
            raise ConfigError(f"--trace {args.trace}: cannot write the trace: {error}") from None
        report["trace"] = str(args.trace)
    if tokenizer is not None:
        report["text"] = [tokenizer.decode(ids) for ids in report["token_ids"]]
    return report


def _device(name: str | None) -> Any:
    """The compute (and KV landing) device: ``name``, or CUDA where there is one.

    Raises:
        ConfigError: not a device name, or CUDA asked for where there is none.
    """
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device (cpu, cuda, cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: this machine has no CUDA device (use cpu)")
    return device


def _load_tokenizer(path: Path) -> Any:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` file or a folder that holds one.

    Raises:
        ConfigError: no such file, or the tokenizers package is missing.
    """
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"tokenizer {file} not found (give a tokenizer.json or its folder)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(
            "--tokenizer needs the tokenizers package (pip install tokenizers)"
        ) from None
    try:
        return Tokenizer.from_file(str(file))
    except Exception as error:  # the Rust side raises plain Exception subclasses
        raise ConfigError(f"cannot read tokenizer {file}: {error}") from None


def _print_report(report: dict[str, Any]) -> None:
    shown = report["token_ids"][:4]
    for index, ids in enumerate(shown):
        line = " ".join(str(i) for i in ids)
        if "text" in report:
            line += f"   {report['text'][index]!r}"
        print(f"[{index}] {line}")
    if len(report["token_ids"]) > len(shown):
        print(f"... {len(report['token_ids']) - len(shown)} more sequences (--json shows all)")
    split = report["path_split"]
    rows: list[list[object]] = [
        ["model", report["model"]],
        ["policy", report["policy"]],
        ["device", report["device"]],
        [
            "batch x prompt + gen",
            f"{report['batch']} x {report['prompt_len']} + {report['gen_len']}",
        ],
        ["prefill", f"{report['prefill_s'] * 1e3:.1f} ms"],
        [
            "decode (total)",
            f"{report['decode_s'] * 1e3:.1f} ms over {len(report['decode_step_s'])} steps",
        ],
        ["tokens/s", f"{report['tokens_per_s']:.1f}"],
    ]
    if "trace" in report:
        rows.append(["trace", report["trace"]])
    if "memory_layers" in split:
        rows.append(["KV cache", "in memory (the reference)"])
    else:
        hit = report["page_cache_hit_rate"]
        rows += [
            ["page-cache layers", _layers(split["page_cache_layers"])],
            ["direct layers", _layers(split["direct_layers"])],
            ["bytes read", _per_path(report["read_bytes"])],
            ["bytes written", _per_path(report["write_bytes"])],
            ["page-cache hit rate", "n/a" if hit is None else f"{hit:.1%}"],
            ["strategy", report["strategy"]],
        ]
    print(format_table(["", ""], rows).split("\n", 2)[2], file=sys.stdout)


def _layers(layers: list[int]) -> str:
    from dualblade.commands.run import _ranges

    return _ranges(layers)


def _per_path(counts: dict[str, int]) -> str:
    return ", ".join(f"{path} {n / 2**20:.2f} MiB" for path, n in counts.items()) or "none"
