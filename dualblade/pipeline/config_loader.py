"""Reading a :class:`PipelineConfig` from TOML or YAML, with environment overrides, and saying
clearly what is wrong with a bad one.

Environment overrides
    A variable ``DUALBLADE__<SECTION>__<FIELD>=<value>`` replaces one field after the file is read:
    the name after the ``DUALBLADE__`` prefix is split on double underscores into the field path
    and lower-cased, so ``DUALBLADE__MEMORY__LIMIT=2GiB`` sets ``memory.limit``,
    ``DUALBLADE__STORAGE__DIRECT__FIRST_LBA=2048`` sets ``storage.direct.first_lba`` and
    ``DUALBLADE__COPY_THREADS=4`` sets the top-level ``copy_threads``. Values are strings that the
    config's own validation converts (``"8"`` to 8, ``"true"`` to True); the exact value ``null``
    unsets an optional field. Missing tables are created. Variables with a single underscore after
    ``DUALBLADE`` are not overrides and are left alone.

Errors
    Every problem becomes one :class:`~dualblade.errors.ConfigError` whose message is a single
    paragraph: the file, then each bad field as a dotted path with what is allowed there (for an
    unknown key, the keys that are known). The CLI prints it and exits with status 2.
"""

from __future__ import annotations

import json
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from dualblade.errors import ConfigError
from dualblade.pipeline.config import PipelineConfig

ENV_PREFIX = "DUALBLADE__"
_MAX_SHOWN_INPUT = 60


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> PipelineConfig:
    """Read, override and validate a pipeline config file (``.toml``, ``.yaml`` or ``.yml``).

    Args:
        path: the file.
        env: the environment to take ``DUALBLADE__*`` overrides from; ``os.environ`` when None.

    Raises:
        ConfigError: the file is missing, unreadable, not valid TOML/YAML, or not a valid config.
    """
    path = Path(path)
    data = _read_mapping(path)
    return config_from_mapping(data, source=str(path), env=env)


def load_default_config(env: Mapping[str, str] | None = None) -> PipelineConfig:
    """The embedded default config (``default.toml`` of this package: what ``dualblade run``
    runs without a file), with environment overrides.

    Args:
        env: the environment to take ``DUALBLADE__*`` overrides from; ``os.environ`` when None.

    Raises:
        ConfigError: an override makes it invalid.
    """
    text = resources.files("dualblade.pipeline").joinpath("default.toml").read_text()
    return config_from_mapping(tomllib.loads(text), source="embedded default", env=env)


def config_from_mapping(
    data: Mapping[str, Any], source: str = "config", env: Mapping[str, str] | None = None
) -> PipelineConfig:
    """Validate an already-parsed mapping, after applying environment overrides.

    Raises:
        ConfigError: one paragraph naming every invalid field of ``source``.
    """
    merged = apply_env_overrides(data, os.environ if env is None else env)
    try:
        return PipelineConfig.model_validate(merged)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, source)) from None


def apply_env_overrides(data: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """Return a copy of ``data`` with every ``DUALBLADE__A__B=value`` written to ``a.b``.

    Raises:
        ConfigError: an override's path crosses a value that is not a table.
    """
    merged: dict[str, Any] = _deep_copy(data)
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX):
            continue
        keys = [key.lower() for key in name[len(ENV_PREFIX) :].split("__")]
        if not all(keys):
            raise ConfigError(f"environment override {name}: empty field name in the path")
        table = merged
        for depth, key in enumerate(keys[:-1]):
            child = table.setdefault(key, {})
            if not isinstance(child, dict):
                where = ".".join(keys[: depth + 1])
                raise ConfigError(
                    f"environment override {name}: {where} is a value, not a table, "
                    "so it has no fields to set"
                )
            table = child
        value = env[name]
        table[keys[-1]] = None if value == "null" else value
    return merged


def config_json_schema() -> dict[str, Any]:
    """The JSON Schema of a pipeline config (for editors and ``dualblade config schema``)."""
    return PipelineConfig.model_json_schema()


def format_validation_error(error: ValidationError, source: str) -> str:
    """Render pydantic's errors as one paragraph: ``field.path: what is wrong; ...``."""
    problems = []
    for item in error.errors():
        loc = tuple(item["loc"])
        where, model = _describe_loc(loc[:-1]) if loc else ("", PipelineConfig)
        last = _describe_loc(loc)[0] if loc else "(top level)"
        kind = item["type"]
        if kind == "extra_forbidden":
            allowed = ", ".join(model.model_fields) if model else "none"
            text = (
                f"unknown field; the fields allowed{' in ' + where if where else ''} are {allowed}"
            )
        elif kind == "missing":
            text = "required but missing"
        elif kind == "union_tag_invalid":
            ctx = item.get("ctx", {})
            text = f"kind must be one of {ctx.get('expected_tags')} (got {_short(ctx.get('tag'))})"
        else:
            text = str(item["msg"]).removeprefix("Value error, ")
            given = item.get("input")
            if not isinstance(given, dict):  # a whole table as "got" is noise, not a hint
                text = f"{text} (got {_short(given)})"
        problems.append(f"{last or '(top level)'}: {text}")
    plural = "s" if len(problems) > 1 else ""
    return f"{source} is not a valid pipeline config ({len(problems)} problem{plural}): " + (
        "; ".join(problems) + "."
    )


def _read_mapping(path: Path) -> dict[str, Any]:
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml"):
        raise ConfigError(f"{path}: a config file must end in .toml, .yaml or .yml")
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the config file: {error.strerror}") from None
    try:
        data: object = (
            tomllib.loads(raw.decode("utf-8")) if suffix == ".toml" else yaml.safe_load(raw)
        )
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: the config file is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path} is not valid TOML: {error}") from None
    except yaml.YAMLError as error:
        detail = " ".join(str(error).split())
        raise ConfigError(f"{path} is not valid YAML: {detail}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a table of sections (model, workload, ...), "
            f"not {type(data).__name__}"
        )
    return data


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def _short(value: object) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= _MAX_SHOWN_INPUT else text[: _MAX_SHOWN_INPUT - 3] + "..."


def _describe_loc(loc: tuple[int | str, ...]) -> tuple[str, type[BaseModel] | None]:
    """Turn pydantic's location into ``a.b.c`` and the model class that holds its last part.

    A discriminated union puts the chosen tag into the location (``storage.direct.nvme.path``);
    it is folded into the path as ``storage.direct(nvme).path`` so the user sees their own keys.
    """
    model: type[BaseModel] | None = PipelineConfig
    candidates: list[type[BaseModel]] = []
    text = ""
    for part in loc:
        if candidates:
            chosen = [c for c in candidates if _kind_of(c) == part]
            if chosen:
                model, candidates = chosen[0], []
                text += f"({part})"
                continue
            candidates = []
        if isinstance(part, int):
            text += f"[{part}]"
            model = None
            continue
        text = f"{text}.{part}" if text else str(part)
        field = model.model_fields.get(part) if model else None
        members = _models_in(field.annotation) if field else []
        model = members[0] if len(members) == 1 else None
        candidates = members if len(members) > 1 else []
    return text, model


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def _kind_of(model: type[BaseModel]) -> object:
    field = model.model_fields.get("kind")
    if field is None:
        return None
    args = typing.get_args(field.annotation)
    return args[0] if args else None
