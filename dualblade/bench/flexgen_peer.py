"""The real FlexGen (PyPI ``flexgen`` 0.1.8) as a sweep policy, ``flexgen``, beside ours.

Run as ``python -m dualblade.bench.flexgen_peer SPEC.json`` by the sweep, in the run's memory
cgroup like every other policy. It needs CUDA and the ``flexgen`` package (installed with
``--no-deps``; its other needs are torch, numpy, transformers). Two stand-ins make it run offline
and under small limits, and change nothing it measures:

- ``AutoTokenizer.from_pretrained`` (it would fetch OPT's tokenizer from the hub) is replaced by
  an object whose call returns ``prompt_len`` token ids, which is all ``run_flexgen`` uses;
- each of its disk copy threads pins a relay buffer of ``1 * GB`` fp16 elements (2 GB, 8 GB for
  four); ``GB`` in its backend module is set to ``RELAY_ELEMENTS`` instead, enough for the largest
  single copy of the paper's shape, so that a 3–6 GiB limit does not kill it for memory it never
  uses. The backend uses that name for nothing else but the size it prints in ``print_stats``
  (stdout, which the sweep ignores; the log it parses is written with ``flexgen.utils.GB``).

Its arguments are the paper's setup: weights on the GPU, the KV cache 100 % on disk (numpy
memmap through the page cache), activations on the GPU; ``--path _DUMMY_`` gives dummy weights.
Prefill and decode latency come from its own benchmark log.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from dualblade.bench.process_stats import storage_read_bytes

#: 80 M fp16 elements (160 MB): above the largest relay copy of OPT-6.7B, batch 32, 512 + 32.
RELAY_ELEMENTS = 80_000_000

_MODELS = {
    "opt-6.7b": "facebook/opt-6.7b",
    "opt-13b": "facebook/opt-13b",
    "opt-1.3b": "facebook/opt-1.3b",
}


class _PromptIds:
    def __init__(self, ids: list[int]) -> None:
        self.input_ids = [ids]


class _OfflineTokenizer:
    """Stands in for OPT's tokenizer: every prompt becomes ``max_length`` fixed ids."""

    def __call__(self, prompts: list[str], padding: str = "", max_length: int = 0) -> _PromptIds:
        return _PromptIds([2] + [(7 * i) % 50000 + 4 for i in range(max_length - 1)])


def parse_log(text: str) -> dict[str, float]:
    """Prefill and decode latency (seconds) from FlexGen's benchmark log."""
    out = {}
    for key, name in (("prefill latency", "prefill_s"), ("decode latency", "decode_s")):
        match = re.search(rf"{key}: ([0-9.]+) s", text)
        if match is None:
            raise ValueError(f"FlexGen's log has no {key!r}: {text[:200]!r}")
        out[name] = float(match.group(1))
    return out


def run_peer(spec: dict[str, Any]) -> dict[str, Any]:
    """Run FlexGen once with the spec's shape; returns its latencies."""
    import argparse

    from flexgen import flex_opt, pytorch_backend  # type: ignore[import-not-found]

    config = spec["config"]
    preset = config["model"].get("preset", "")
    if preset not in _MODELS:
        raise ValueError(f"FlexGen runs OPT presets only ({', '.join(_MODELS)}), not {preset!r}")
    workload = config["workload"]
    offload = Path(spec["offload_dir"])
    offload.mkdir(parents=True, exist_ok=True)
    log_file = offload / "flexgen.log"
    if log_file.exists():
        log_file.unlink()
    flex_opt.AutoTokenizer.from_pretrained = lambda *a, **k: _OfflineTokenizer()
    pytorch_backend.GB = RELAY_ELEMENTS
    parser = argparse.ArgumentParser()
    flex_opt.add_parser_arguments(parser)
    args = parser.parse_args(
        [
            "--model", _MODELS[preset],
            "--path", "_DUMMY_",
            "--offload-dir", str(offload),
            "--percent", "100", "0", "0", "0", "100", "0",
            "--gpu-batch-size", str(workload["batch"]),
            "--num-gpu-batches", "1",
            "--prompt-len", str(workload["prompt_len"]),
            "--gen-len", str(spec["decode_steps"] + 1),
            "--log-file", str(log_file),
        ]
    )  # fmt: skip
    read_before = storage_read_bytes()
    flex_opt.run_flexgen(args)
    result = parse_log(log_file.read_text())
    return {
        "policy": "flexgen",
        **result,
        "decode_step_s": [],
        "decode_storage_read_bytes": storage_read_bytes() - read_before,
        "hit_rate": None,
        "strategy": "n/a",
        "decode_read_bytes": {},
        "requests": {"decode": {"latency": {}, "sequentiality": None}},
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m dualblade.bench.flexgen_peer SPEC.json``."""
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(args[0]).read_text())
    procs = spec.get("cgroup_procs")
    if procs:
        Path(procs).write_text(str(os.getpid()))
    try:
        report = run_peer(spec)
    except ImportError as error:
        report = {"error": f"the flexgen package is not installed ({error})"}
    except Exception as error:  # the peer's failure is a record, not our crash
        report = {"error": f"FlexGen failed: {type(error).__name__}: {error}"}
    Path(spec["out"]).write_text(json.dumps(report))
    return 0 if "error" not in report else 1


if __name__ == "__main__":
    sys.exit(main())
