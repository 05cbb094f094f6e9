"""OPT architectures, deterministic random weights, and safetensors checkpoints that load back."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dualblade.errors import ConfigError
from dualblade.models.architecture import OptArchitecture
from dualblade.models.checkpoint import load_checkpoint, save_checkpoint
from dualblade.models.factory import build_model
from dualblade.models.weights import OptWeights, parameter_shapes, random_weights

TINY = OptArchitecture.from_preset("opt-tiny")


def test_presets_carry_the_opt_family_numbers() -> None:
    arch = OptArchitecture.from_preset("OPT-6.7B")
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.head_dim) == (32, 4096, 32, 128)
    assert (arch.ffn_dim, arch.vocab_size, arch.max_positions) == (16384, 50272, 2048)
    assert arch.shape().kpu_bytes(32, 544) == 136 << 20  # the pipeline sizes the same cache
    assert (TINY.num_layers, TINY.hidden_size, TINY.vocab_size) == (4, 64, 1024)


def test_non_opt_and_unknown_presets_are_refused() -> None:
    with pytest.raises(ConfigError, match="not an OPT model"):
        OptArchitecture.from_preset("llama-3-8b")
    with pytest.raises(ConfigError, match="unknown model preset"):
        OptArchitecture.from_preset("opt-7b")


def test_hf_config_round_trip_and_refusals() -> None:
    arch = OptArchitecture(
        "x", 2, 64, 4, 96, 300, 64, layer_norm_before=False, word_embed_dim=32, kv_dtype="bfloat16"
    )
    assert OptArchitecture.from_hf_config(arch.to_hf_config(), name="x") == arch
    config = arch.to_hf_config()
    with pytest.raises(ConfigError, match="only 'opt'"):
        OptArchitecture.from_hf_config({**config, "model_type": "llama"})
    with pytest.raises(ConfigError, match="'relu'"):
        OptArchitecture.from_hf_config({**config, "activation_function": "gelu"})
    with pytest.raises(ConfigError, match="lacks 'ffn_dim'"):
        OptArchitecture.from_hf_config({k: v for k, v in config.items() if k != "ffn_dim"})


def test_random_weights_are_deterministic_and_seeded() -> None:
    a, b, c = random_weights(TINY, 5), random_weights(TINY, 5), random_weights(TINY, 6)
    assert set(a.tensors) == set(parameter_shapes(TINY))
    assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)
    assert not torch.equal(a.tensors["layers.0.fc1.weight"], c.tensors["layers.0.fc1.weight"])


def test_a_missing_or_misshapen_tensor_is_named() -> None:
    tensors = dict(random_weights(TINY, 0).tensors)
    fc1 = tensors.pop("layers.3.fc1.weight")
    with pytest.raises(ConfigError, match=r"missing 1 tensors: layers\.3\.fc1\.weight"):
        OptWeights(TINY, tensors)
    with pytest.raises(ConfigError, match=r"layers\.3\.fc1\.weight has shape \[64, 256\]"):
        OptWeights(TINY, {**tensors, "layers.3.fc1.weight": fc1.t()})


def test_a_saved_folder_loads_back_bit_for_bit(tmp_path: Path) -> None:
    weights = random_weights(TINY, 7)
    save_checkpoint(weights, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 4
    loaded = load_checkpoint(tmp_path)
    assert loaded.arch == dataclasses.replace(TINY, name=tmp_path.name)
    assert all(torch.equal(loaded.tensors[n], weights.tensors[n]) for n in weights.tensors)


def test_a_bare_file_needs_an_architecture(tmp_path: Path) -> None:
    weights = random_weights(TINY, 7)
    # OPTModel's "decoder." prefix, fp16 on disk: loaded under canonical names, in float32
    file = tmp_path / "weights.safetensors"
    save_file({f"decoder.{n}": t.half() for n, t in weights.tensors.items()}, str(file))
    with pytest.raises(ConfigError, match=r"needs a config\.json beside it or a preset"):
        load_checkpoint(file)
    loaded = load_checkpoint(file, arch=TINY)
    assert loaded.tensors["embed_tokens.weight"].dtype == torch.float32
    assert torch.equal(
        loaded.tensors["layers.1.fc2.bias"], weights.tensors["layers.1.fc2.bias"].half().float()
    )


def test_bad_paths_and_foreign_tensors_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"\*\.safetensors"):
        load_checkpoint(tmp_path)  # an empty folder
    save_checkpoint(random_weights(TINY, 0), tmp_path)
    save_file(
        {"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)}, str(tmp_path / "x.safetensors")
    )
    with pytest.raises(ConfigError, match="not OPT parameters"):
        load_checkpoint(tmp_path)


def test_build_model_from_a_checkpoint_equals_the_preset(tmp_path: Path) -> None:
    save_checkpoint(random_weights(TINY, 11), tmp_path)
    from_disk = build_model(model_path=str(tmp_path))
    from_seed = build_model(preset="opt-tiny", seed=11)
    assert from_disk.arch.num_layers == from_seed.arch.num_layers
    for name, tensor in from_seed.weights.tensors.items():
        assert torch.equal(from_disk.weights.tensors[name], tensor)
    with pytest.raises(ConfigError, match="name a model"):
        build_model()
