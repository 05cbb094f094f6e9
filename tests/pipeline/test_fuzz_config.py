"""Fuzzed configs: mutated mappings, environment overrides and raw TOML/YAML text.

Each must load into a :class:`PipelineConfig` that plans (or is refused by the planner with a
:class:`~dualblade.errors.DualbladeError`), or be refused with one readable
:class:`~dualblade.errors.ConfigError`; never any other exception type.
"""

from __future__ import annotations

import contextlib
import copy
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from dualblade.errors import ConfigError, DualbladeError
from dualblade.pipeline import PipelineConfig, config_from_mapping, load_config
from dualblade.pipeline.config import BlockTarget, FileTarget, NvmeTarget
from dualblade.pipeline.planner import budget_for, make_plan

BASE: dict[str, Any] = {
    "model": {"num_layers": 4, "hidden_size": 512, "num_heads": 8, "dtype": "float16"},
    "workload": {"batch": 4, "prompt_len": 16, "max_new_tokens": 4},
    "memory": {"page_cache_budget": "8MiB"},
    "storage": {"direct": {"path": "/nonexistent/dualblade/direct.kv"}},
    "policy": "dual",
}


def _paths() -> list[tuple[str, ...]]:
    """Every field of the config, as a key path (``("memory", "knob_x")``)."""
    out: list[tuple[str, ...]] = []

    def walk(model: type[BaseModel], prefix: tuple[str, ...]) -> None:
        for name, info in model.model_fields.items():
            out.append((*prefix, name))
            kind = info.annotation
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                walk(kind, (*prefix, name))

    walk(PipelineConfig, ())
    for target in (FileTarget, BlockTarget, NvmeTarget):
        walk(target, ("storage", "direct"))
    return sorted(set(out))


PATHS = _paths()

sizes = st.one_of(
    st.integers(-(2**64), 2**64),
    st.from_regex(r"\A\s?-?\d{0,6}(\.\d{0,3})?\s?[kKmMgGtTpPeEiIbB]{0,3}\s?\Z"),
    st.sampled_from(["auto", "4GiB", "0", "1e999", "nan", "inf", "-1k", "1 TiB", "12.5MiB"]),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    sizes,
    st.sampled_from(["opt-6.7b", "llama-3-8b", "file", "block", "nvme", "dual", "cross"]),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


#: Values a real config could hold for some field, so that many mutants still validate.
plausible = st.one_of(
    st.integers(0, 64),
    st.sampled_from([4096, 512, 2**20, "1MiB", "64KiB", "auto", "float16", "bfloat16", "file"]),
    st.sampled_from(["direct", "page-cache", "cache-policy", "baseline", "intra", "debug"]),
)


@st.composite
def mappings(draw: st.DrawFn) -> dict[str, Any]:
    """The base config with a few fields replaced, removed or added."""
    data = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(PATHS))
        action = draw(st.sampled_from(["set", "set", "set", "delete", "extra"]))
        table = data
        for key in path[:-1]:
            child = table.get(key)
            if not isinstance(child, dict):
                child = table[key] = {}
            table = child
        if action == "delete":
            table.pop(path[-1], None)
        elif action == "extra":
            table[draw(st.text(min_size=1, max_size=8))] = draw(values)
        else:
            table[path[-1]] = draw(st.one_of(plausible, values))
    return data


def _load_and_plan(load: Any) -> None:
    """``load()`` must give a config that plans, or one of our errors."""
    message = ""
    try:
        config = load()
    except ConfigError as error:
        message = str(error)
    if message:
        event("config refused")
        assert message.strip()
        assert "Traceback" not in message
        return
    event("config accepted")
    assert isinstance(config, PipelineConfig)
    refusal: str | None = None
    try:
        make_plan(config, budget_for(config, memory_limit=8 << 30))
    except DualbladeError as error:
        refusal = str(error)
    event("planned" if refusal is None else "plan refused")
    assert refusal is None or refusal.strip()


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(data=mappings())
def test_fuzzed_mappings_load_or_give_config_errors(data: dict[str, Any]) -> None:
    _load_and_plan(lambda: config_from_mapping(data, env={}))


@FUZZ
@given(
    overrides=st.dictionaries(
        st.one_of(
            st.sampled_from(PATHS).map(lambda p: "DUALBLADE__" + "__".join(p).upper()),
            st.text(max_size=20).map(lambda s: "DUALBLADE__" + s),
        ),
        st.text(max_size=12) | st.sampled_from(["null", "4GiB", "auto", "-1", "1e3"]),
        max_size=3,
    )
)
def test_fuzzed_environment_overrides(overrides: dict[str, str]) -> None:
    _load_and_plan(lambda: config_from_mapping(BASE, env=overrides))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value).replace("inf", "inf")
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value if v is not None) + "]"
    if isinstance(value, dict):
        items = ", ".join(f'"{k}" = {_toml_value(v)}' for k, v in value.items() if v is not None)
        return "{" + items + "}"
    return '""'


def _to_toml(data: dict[str, Any], prefix: str = "") -> str:
    lines, tables = [], []
    for key, value in data.items():
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
            tables.append((key, value))
        elif value is not None:
            lines.append(f'"{key}" = {_toml_value(value)}')
    out = "\n".join(lines)
    for key, value in tables:
        name = f'{prefix}"{key}"'
        out += f"\n[{name}]\n" + _to_toml(value, name + ".")
    return out


@FUZZ
@given(
    data=mappings(),
    cut=st.integers(0, 400),
    junk=st.text(max_size=8),
    raw=st.binary(max_size=40),
    form=st.sampled_from(["toml", "toml-corrupt", "yaml", "bytes"]),
)
def test_fuzzed_files_load_or_give_config_errors(
    data: dict[str, Any], cut: int, junk: str, raw: bytes, form: str
) -> None:
    with tempfile.TemporaryDirectory() as folder:
        suffix = ".yaml" if form == "yaml" else ".toml"
        path = Path(folder) / f"pipeline{suffix}"
        if form == "bytes":
            path.write_bytes(raw)
        elif form == "yaml":
            import yaml

            text = yaml.safe_dump(data) if cut % 2 else junk + yaml.safe_dump(data)[:cut]
            path.write_text(text)
        else:
            text = _to_toml(data)
            if form == "toml-corrupt":
                text = text[:cut] + junk + text[cut:]
            path.write_text(text)
        _load_and_plan(lambda: load_config(path, env={}))


@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
def test_base_config_round_trips_through_the_file_writers(suffix: str, tmp_path: Path) -> None:
    """The serializers above really produce loadable files (so the fuzz reaches validation)."""
    path = tmp_path / f"p{suffix}"
    if suffix == ".toml":
        path.write_text(_to_toml(BASE))
    else:
        import yaml

        path.write_text(yaml.safe_dump(BASE))
    assert load_config(path, env={}).workload.batch == 4


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("model", "num_layers", 10**12),  # planning listed every layer: MemoryError before
        ("model", "num_layers", 2**70),
        ("workload", "batch", 2**62),
        ("model", "hidden_size", 2**40),
        ("memory", "page_cache_budget", 2**80),
    ],
)
def test_extreme_numbers_load_or_give_our_errors(section: str, field: str, value: int) -> None:
    data = copy.deepcopy(BASE)
    data[section][field] = value
    try:
        config = config_from_mapping(data, env={})
    except ConfigError as error:
        message = str(error)
    else:
        with contextlib.suppress(DualbladeError):
            make_plan(config, budget_for(config, memory_limit=8 << 30))
        return
    assert field in message
