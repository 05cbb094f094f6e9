"""``dualblade generate``: every policy yields the in-memory reference's ids; bad input is one
readable error, no traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from dualblade.cli import main
from dualblade.models.architecture import OptArchitecture
from dualblade.models.checkpoint import save_checkpoint
from dualblade.models.factory import random_prompts
from dualblade.models.kv import MemoryKV
from dualblade.models.opt import OptModel
from dualblade.models.weights import random_weights

POLICIES = ["dual", "direct", "page-cache", "cache-policy", "baseline", "memory"]
TINY = OptArchitecture.from_preset("opt-tiny")
MUST_SHOW = ["--preset", "opt-tiny", "--batch", "4", "--prompt-len", "64", "--gen-len", "8"]


def generate(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["generate", *argv, "--device", "cpu", "--json"]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


def test_every_policy_generates_the_same_ids(
    capsys: pytest.CaptureFixture[str], opt_pipeline_toml: Path, opt_tiny: OptModel
) -> None:
    """The issue's must-show: the same token ids under all six policies."""
    reports = {
        policy: generate(capsys, *MUST_SHOW, "--policy", policy, "--config", str(opt_pipeline_toml))
        for policy in POLICIES
    }
    ids = {policy: report["token_ids"] for policy, report in reports.items()}
    assert all(i == ids["memory"] for i in ids.values()), ids
    # ... and they are the library's: opt-tiny, seed 0, the seed-0 prompts, an in-RAM cache
    prompts = random_prompts(4, 64, 1024, seed=0)
    kv = MemoryKV(layers=4, batch=4, max_len=72, width=64, dtype=torch.float16)
    expected = anyio.run(opt_tiny.generate, prompts, 8, kv).tokens.tolist()
    assert ids["memory"] == expected
    assert len({t for row in expected for t in row}) > 8  # varied tokens: a real check

    # every path carried the KV cache it was given
    dual = reports["dual"]
    assert dual["path_split"]["page_cache_layers"] == [0, 2]  # spread: page_cache_order
    assert dual["path_split"]["direct_layers"] == [1, 3]
    assert dual["read_bytes"]["direct"] > 0
    assert dual["read_bytes"]["page-cache"] > 0
    assert set(reports["direct"]["read_bytes"]) == {"direct"}
    assert set(reports["baseline"]["read_bytes"]) == {"baseline"}
    assert reports["memory"]["path_split"] == {"memory_layers": [0, 1, 2, 3]}
    for report in reports.values():
        assert report["gen_len"] == 8
        assert len(report["decode_step_s"]) == 7
        assert report["prefill_s"] > 0
        assert report["tokens_per_s"] > 0


def test_a_checkpoint_folder_generates_like_its_preset(
    capsys: pytest.CaptureFixture[str], opt_pipeline_toml: Path, tmp_path: Path
) -> None:
    folder = save_checkpoint(random_weights(TINY, 3), tmp_path / "ckpt")
    common = ["--batch", "2", "--prompt-len", "16", "--gen-len", "4", "--seed", "3"]
    config = ["--config", str(opt_pipeline_toml), "--policy", "direct"]
    from_preset = generate(capsys, "--preset", "opt-tiny", *common, *config)
    from_disk = generate(capsys, "--model", str(folder), *common, *config)
    assert from_disk["token_ids"] == from_preset["token_ids"]
    assert from_disk["model"] == "ckpt"


def test_the_text_report_shows_ids_and_the_path_split(
    capsys: pytest.CaptureFixture[str], opt_pipeline_toml: Path
) -> None:
    argv = ["generate", *MUST_SHOW, "--config", str(opt_pipeline_toml), "--device", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("[0] ")
    assert "page-cache layers" in out
    assert "0, 2" in out  # two of four layers, spread over the model
    assert "direct layers" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "opt-tiny", "--gen-len", "0"], "--gen-len must be at least 1"),
        (["--preset", "opt-7b"], "unknown model preset 'opt-7b'"),
        (["--preset", "llama-3-8b"], "not an OPT model"),
        (["--model", "/nonexistent/opt"], "model path /nonexistent/opt does not exist"),
        (["--preset", "opt-tiny", "--prompt-len", "0"], "at least 1"),
        (["--preset", "opt-tiny", "--prompt-len", "510", "--gen-len", "8"], "512 positions"),
        (["--preset", "opt-tiny", "--prompt", "hi"], "--prompt needs --tokenizer"),
        (["--preset", "opt-tiny", "--tokenizer", "/nonexistent"], "tokenizer /nonexistent"),
        (["--preset", "opt-tiny", "--device", "gpu0"], "is not a device"),
    ],
)
def test_bad_input_is_one_readable_error(
    capsys: pytest.CaptureFixture[str], opt_pipeline_toml: Path, argv: list[str], message: str
) -> None:
    status = main(["generate", "--device", "cpu", *argv, "--config", str(opt_pipeline_toml)])
    err = capsys.readouterr().err
    assert status == 2
    assert message in err
    assert "Traceback" not in err


def test_a_local_tokenizer_encodes_the_prompt_and_decodes_the_ids(
    capsys: pytest.CaptureFixture[str], opt_pipeline_toml: Path, tmp_path: Path
) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(1024)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    prompt = " ".join(f"w{i}" for i in (5, 17, 300, 999, 42))

    report = generate(
        capsys,
        *("--preset", "opt-tiny", "--batch", "2", "--gen-len", "4"),
        *("--tokenizer", str(tmp_path), "--prompt", prompt),
        *("--config", str(opt_pipeline_toml), "--policy", "memory"),
    )
    assert report["prompt_len"] == 5
    assert report["token_ids"][0] == report["token_ids"][1]  # the prompt repeated per sequence
    assert report["text"] == [" ".join(f"w{i}" for i in ids) for ids in report["token_ids"]]
    prompts = torch.tensor([[5, 17, 300, 999, 42]] * 2)
    kv = MemoryKV(layers=4, batch=2, max_len=9, width=64, dtype=torch.float16)
    model = OptModel(random_weights(TINY, 0))
    assert report["token_ids"] == anyio.run(model.generate, prompts, 4, kv).tokens.tolist()
