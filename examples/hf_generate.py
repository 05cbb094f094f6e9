"""transformers ``generate()`` with its KV cache in dualblade, timed beside dualblade's own engine.

Run it (``pip install -e '.[hf]'`` or any transformers 5)::

    python examples/hf_generate.py --preset opt-1.3b --batch 8 --prompt-len 512 --gen-len 8
    python examples/hf_generate.py --preset opt-6.7b --batch 32 --prompt-len 512 --gen-len 8 \\
        --memory-limit 6GiB --device cuda --compare

An OPT model of the preset's shape with random fp16 weights (no hub is reachable) runs
``model.generate(..., past_key_values=DualBladeCache(...))``; each step's time is taken when the
logits processors run (once per new token). With ``--compare`` the same shape, policy and limit
run through ``dualblade generate``'s engine on the cache's own store config, in the same process,
alternating, ``--repeats`` times; it prints prefill and decode seconds of both (medians), each
step's seconds, and the ratios of decodes and of whole generations. The two prefills end at
different points: the engine's once its K and V are written, the cache's at its first logits
with its writes still in flight (write-behind), so the cache's first decode step carries the
rest of its prefill's writes. The whole generation's ratio has no such seam.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from typing import Any

import anyio
import torch
import transformers

from dualblade.models import (
    DualBladeCache,
    OptArchitecture,
    build_model,
    open_kv,
    random_prompts,
)
from dualblade.pipeline import PipelineConfig, parse_size


class _StepClock(transformers.LogitsProcessor):
    """Stamps the time each time generate() has new logits: once per generated token."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.is_cuda:
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        return scores


def _hf_model(arch: OptArchitecture, device: str) -> Any:
    config = transformers.OPTConfig(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        ffn_dim=arch.ffn_dim,
        max_position_embeddings=arch.max_positions,
        word_embed_proj_dim=arch.word_embed_dim or arch.hidden_size,
        do_layer_norm_before=arch.layer_norm_before,
        torch_dtype=torch.float16,
    )
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device(device):
            model = transformers.OPTForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    return model.eval()


def run_hf(model: Any, prompts: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """One generate() with a fresh DualBladeCache: prefill and decode seconds."""
    cache = DualBladeCache(
        model.config,
        max_cache_len=args.prompt_len + args.gen_len,
        batch_size=args.batch,
        policy=args.policy,
        memory_limit=args.memory_limit,
    )
    clock = _StepClock()
    ids = prompts.to(args.device)
    with cache, torch.inference_mode():
        cache.open(args.batch, torch.float16, args.device)  # start-up is not generation
        start = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.gen_len,
            min_new_tokens=args.gen_len,
            do_sample=False,
            past_key_values=cache,
            logits_processor=transformers.LogitsProcessorList([clock]),
        )
        metrics = cache.metrics()
    stamps = [start, *clock.stamps]
    return {
        "prefill_s": stamps[1] - stamps[0],
        "decode_s": stamps[-1] - stamps[1],
        "decode_step_s": [round(b - a, 4) for a, b in itertools.pairwise(stamps[1:])],
        "read_ahead_hits": metrics["cache_read_ahead_hits"],
        "read_ahead_misses": metrics["cache_read_ahead_misses"],
    }


async def run_engine(
    prompts: torch.Tensor, config: PipelineConfig, args: argparse.Namespace
) -> dict[str, Any]:
    """The same shape through ``dualblade generate``'s OPT engine, on the very store config the
    cache opens (the embedded default's knob X would put fewer layers on the page cache)."""
    model = build_model(preset=args.preset, device=args.device, dtype=torch.float16)
    async with open_kv(
        config, args.policy, device=args.device, memory_limit=args.memory_limit
    ) as kv:
        result = await model.generate(prompts, args.gen_len, kv)
    return {
        "prefill_s": result.prefill_s,
        "decode_s": sum(result.decode_step_s),
        "decode_step_s": [round(step, 4) for step in result.decode_step_s],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--preset", default="opt-125m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--gen-len", type=int, default=8)
    parser.add_argument("--policy", default="dual")
    parser.add_argument("--memory-limit", help="plan against this limit, e.g. 6GiB")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compare", action="store_true", help="also run dualblade's engine")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    args.memory_limit = parse_size(args.memory_limit) if args.memory_limit else None
    arch = OptArchitecture.from_preset(args.preset)
    prompts = random_prompts(args.batch, args.prompt_len, arch.vocab_size, seed=0)
    model = _hf_model(arch, args.device)
    runs: dict[str, list[dict[str, Any]]] = {"hf": [], "engine": []}
    config = DualBladeCache(
        model.config,
        max_cache_len=args.prompt_len + args.gen_len,
        batch_size=args.batch,
        policy=args.policy,
    ).config_for(args.batch, torch.float16)
    for _ in range(args.repeats):
        runs["hf"].append(run_hf(model, prompts, args))
        if args.compare:
            runs["engine"].append(anyio.run(run_engine, prompts, config, args))
    summary: dict[str, Any] = {"runs": runs}
    for name, records in runs.items():
        if records:
            summary[name] = {
                key: statistics.median(r[key] for r in records) for key in ("prefill_s", "decode_s")
            }
            summary[name]["total_s"] = statistics.median(
                r["prefill_s"] + r["decode_s"] for r in records
            )
    if args.compare:
        hf, engine = summary["hf"], summary["engine"]
        summary["decode_hf_over_engine"] = hf["decode_s"] / engine["decode_s"]
        # The cache's prefill returns its first token before its writes land (write-behind);
        # the engine's waits for them. The first decode step of the cache pays for the rest.
        summary["total_hf_over_engine"] = hf["total_s"] / engine["total_s"]
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
