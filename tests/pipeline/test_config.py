"""PipelineConfig: the example configs load, TOML/YAML/env agree, bad input gets one paragraph."""

from pathlib import Path

import pytest

from dualblade.errors import ConfigError
from dualblade.pipeline import (
    FileTarget,
    ModelShape,
    NvmeTarget,
    PipelineConfig,
    apply_env_overrides,
    config_for_model,
    config_from_mapping,
    config_json_schema,
    load_config,
    load_default_config,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MINIMAL = {
    "model": {"preset": "opt-125m"},
    "workload": {"batch": 4, "prompt_len": 128, "max_new_tokens": 16},
}


def problems(data, env=None):
    with pytest.raises(ConfigError) as caught:
        config_from_mapping(data, source="t.toml", env=env or {})
    message = str(caught.value)
    assert "\n" not in message, "the error must be one paragraph"
    assert "Traceback" not in message
    return message


def test_paper_config():
    config = load_config(CONFIGS / "opt-6.7b-paper.toml", env={})
    assert config.shape().name == "opt-6.7b"
    assert (config.workload.batch, config.workload.prompt_len) == (32, 512)
    assert config.workload.max_len == 544
    assert isinstance(config.storage.direct, NvmeTarget)
    assert config.storage.direct.extent_blocks() == (16 << 30) // 4096
    assert config.policy == "dual"


def test_default_config_is_small():
    config = load_config(CONFIGS / "default.toml", env={})
    shape, workload = config.shape(), config.workload
    total = shape.total_kv_bytes(workload.batch, workload.max_len)
    assert 10 << 20 <= total <= 400 << 20
    assert isinstance(config.storage.direct, FileTarget)


def test_embedded_default_is_the_shipped_file_with_env_overrides():
    assert load_default_config(env={}) == load_config(CONFIGS / "default.toml", env={})
    overridden = load_default_config(env={"DUALBLADE__COPY_THREADS": "3"})
    assert overridden.copy_threads == 3


def test_config_for_model_lays_shape_and_workload_over_the_base(monkeypatch):
    monkeypatch.setenv("DUALBLADE__COPY_THREADS", "5")  # not applied: the caller's values run
    shape = ModelShape("gqa", 2, 64, 4, 2, 16, "bfloat16")
    base = config_from_mapping({**MINIMAL, "copy_threads": 3}, env={})
    config = config_for_model(
        base, shape, batch=2, prompt_len=5, max_new_tokens=3, policy="direct", source="t"
    )
    assert config.shape() == ModelShape("custom", 2, 64, 4, 2, 16, "bfloat16")
    assert (config.workload.batch, config.workload.max_len) == (2, 8)
    assert (config.copy_threads, config.policy) == (3, "direct")
    from_mapping = config_for_model(
        {"copy_threads": 3, "policy": "direct"}, shape, batch=2, prompt_len=5, max_new_tokens=3
    )
    assert from_mapping == config
    with pytest.raises(ConfigError, match=r"^t is not a valid .*copy_threads"):
        config_for_model(
            {"copy_threads": 0}, shape, batch=1, prompt_len=1, max_new_tokens=0, source="t"
        )


def test_defaults_and_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = config_from_mapping(MINIMAL, env={})
    assert config.storage.direct == FileTarget(path=tmp_path / "dualblade" / "direct.kv")
    assert config.storage.page_cache_dir == tmp_path / "dualblade" / "page-cache"
    assert (config.copy_threads, config.strategy, config.policy) == (2, "auto", "dual")
    assert config.memory.limit is None
    assert config.max_chunk == 1 << 20


def test_direct_without_kind_is_a_file():
    data = {**MINIMAL, "storage": {"direct": {"path": "~/kv.bin", "extent_size": "1GiB"}}}
    direct = config_from_mapping(data, env={}).storage.direct
    assert isinstance(direct, FileTarget)
    assert direct.path == Path.home() / "kv.bin"
    assert direct.extent_blocks() == (1 << 30) // 4096


def test_preset_with_overrides_and_explicit_shape():
    data = {**MINIMAL, "model": {"preset": "llama-3-8b", "num_layers": 4, "dtype": "float16"}}
    shape = config_from_mapping(data, env={}).shape()
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype) == (
        4,
        8,
        128,
        "float16",
    )
    data = {**MINIMAL, "model": {"num_layers": 2, "hidden_size": 256, "num_heads": 4}}
    shape = config_from_mapping(data, env={}).shape()
    assert (shape.name, shape.head_dim, shape.num_kv_heads) == ("custom", 64, 4)


def test_toml_and_yaml_agree(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text(
        '[model]\npreset = "opt-1.3b"\n[workload]\nbatch = 8\nprompt_len = 64\n'
        'max_new_tokens = 8\n[memory]\nlimit = "2GiB"\n'
    )
    yaml = tmp_path / "c.yaml"
    yaml.write_text(
        "model: {preset: opt-1.3b}\nworkload: {batch: 8, prompt_len: 64, max_new_tokens: 8}\n"
        "memory: {limit: 2GiB}\n"
    )
    assert load_config(toml, env={}) == load_config(yaml, env={})
    assert load_config(toml, env={}).memory.limit == 2 << 30


def test_env_overrides():
    env = {
        "DUALBLADE__MEMORY__LIMIT": "6GiB",
        "DUALBLADE__WORKLOAD__BATCH": "16",
        "DUALBLADE__COPY_THREADS": "3",
        "DUALBLADE__STORAGE__DIRECT__KIND": "block",
        "DUALBLADE__STORAGE__DIRECT__PATH": "/dev/loop7",
        "DUALBLADE__STORAGE__DIRECT__EXTENT_SIZE": "1GiB",
        "DUALBLADE__MEMORY__KNOB_X": "null",
        "DUALBLADE_UNRELATED": "x",
    }
    config = config_from_mapping({**MINIMAL, "memory": {"knob_x": "1GiB"}}, env=env)
    assert config.memory.limit == 6 << 30
    assert config.memory.knob_x is None
    assert config.workload.batch == 16
    assert config.copy_threads == 3
    assert config.storage.direct.kind == "block"
    assert str(config.storage.direct.path) == "/dev/loop7"


def test_env_override_into_a_value_is_refused():
    with pytest.raises(ConfigError, match=r"DUALBLADE__POLICY__X: policy is a value"):
        apply_env_overrides({"policy": "dual"}, {"DUALBLADE__POLICY__X": "1"})


def test_env_override_errors_name_the_field():
    message = problems(MINIMAL, env={"DUALBLADE__WORKLOAD__BATCH": "many"})
    assert "workload.batch" in message
    assert "'many'" in message


def test_errors_name_every_field_and_what_is_allowed():
    data = {
        "model": {"preset": "opt-6.7x"},
        "workload": {"batch": 0, "prompt_len": 16, "max_new_tokens": 1},
        "strategy": "fast",
        "colour": "blue",
    }
    message = problems(data)
    assert message.startswith("t.toml is not a valid pipeline config (4 problems): ")
    assert "model: unknown model preset 'opt-6.7x'" in message
    assert "workload.batch: Input should be greater than 0 (got 0)" in message
    assert "strategy: Input should be 'auto', 'intra' or 'cross' (got 'fast')" in message
    assert "colour: unknown field; the fields allowed are model, workload, storage" in message


def test_union_errors_fold_the_kind_into_the_path():
    data = {**MINIMAL, "storage": {"direct": {"kind": "nvme", "path": "/dev/ng0n1", "lba": 1}}}
    message = problems(data)
    assert "storage.direct(nvme).extent_size: required but missing" in message
    assert (
        "storage.direct(nvme).lba: unknown field; the fields allowed in storage.direct(nvme)"
        in (message)
    )
    message = problems({**MINIMAL, "storage": {"direct": {"kind": "tape"}}})
    assert "storage.direct: kind must be one of 'nvme', 'block', 'file' (got 'tape')" in message


@pytest.mark.parametrize(
    ("section", "needle"),
    [
        ({"memory": {"limit": "lots"}}, "memory.limit: 'lots' is not a size"),
        ({"memory": {"safety_fraction": 1.5}}, "memory.safety_fraction"),
        ({"max_chunk": "6KiB"}, "max_chunk (6144 bytes) must be a multiple"),
        ({"copy_threads": 0}, "copy_threads"),
        ({"policy": "lru"}, "'dual', 'direct', 'page-cache', 'cache-policy' or 'baseline'"),
        (
            {"storage": {"direct": {"kind": "block", "path": "/dev/x", "extent_size": 1000}}},
            "extent_size (1000 bytes) must be a positive multiple of lba_size (4096)",
        ),
        ({"storage": {"direct": {"lba_size": 1000}}}, "lba_size must be a power of two"),
        ({"model": {"num_layers": 2}}, "give either a preset or num_layers"),
    ],
)
def test_specific_errors(section, needle):
    assert needle in problems({**MINIMAL, **section})


def test_memory_limit_accepts_auto_and_sizes():
    assert (
        config_from_mapping({**MINIMAL, "memory": {"limit": "auto"}}, env={}).memory.limit is None
    )
    assert config_from_mapping({**MINIMAL, "memory": {"limit": 1024}}, env={}).memory.limit == 1024


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        ("bad.toml", "[model\npreset = 1", "is not valid TOML"),
        ("bad.yaml", "model: [unclosed", "is not valid YAML"),
        ("list.yaml", "- 1\n- 2\n", "top level must be a table"),
        ("empty.yaml", "", "top level must be a table"),
        ("c.json", "{}", "must end in .toml, .yaml or .yml"),
    ],
)
def test_file_errors(tmp_path, name, text, needle):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle) as caught:
        load_config(path, env={})
    assert "\n" not in str(caught.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path / "nope.toml", env={})


def test_frozen_and_extra_forbidden():
    config = config_from_mapping(MINIMAL, env={})
    with pytest.raises(ValueError, match="frozen"):
        config.copy_threads = 4  # type: ignore[misc]
    assert PipelineConfig.model_config.get("extra") == "forbid"


def test_json_schema():
    schema = config_json_schema()
    assert schema["title"] == "dualblade pipeline config"
    assert set(schema["required"]) == {"model", "workload"}
    assert "anyOf" in schema["properties"]["max_chunk"]
    direct = schema["$defs"]["StorageSection"]["properties"]["direct"]
    assert direct["discriminator"]["propertyName"] == "kind"
    assert schema["$defs"]["MemorySection"]["additionalProperties"] is False
