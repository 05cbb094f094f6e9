"""Local OPT checkpoints: a Hugging Face model folder or a bare safetensors file.

A folder is what ``save_pretrained`` writes — ``config.json`` and one or more ``*.safetensors``
shards under OPT's parameter names (``model.decoder.layers.0.fc1.weight``; ``OPTModel``'s
``decoder.`` prefix and none at all are accepted too). A bare ``.safetensors`` file has no config,
so its architecture comes from a ``config.json`` beside it or from the caller (a preset).
Only safetensors are read: a pickled ``pytorch_model.bin`` can run code when loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dualblade.errors import ConfigError
from dualblade.models.architecture import OptArchitecture
from dualblade.models.weights import OptWeights, parameter_shapes

_PREFIXES = ("model.decoder.", "decoder.")
_LM_HEAD = "lm_head.weight"


def load_checkpoint(
    path: str | Path,
    *,
    arch: OptArchitecture | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> OptWeights:
    """Load an OPT checkpoint onto ``device`` in ``dtype``.

    Args:
        path: a folder with ``config.json`` and ``*.safetensors``, or one ``.safetensors`` file.
        arch: the architecture, where the checkpoint has no ``config.json`` (it wins over one).

    Raises:
        ConfigError: the path is missing or holds no safetensors, there is no architecture, a
            tensor is missing or has the wrong shape, or names are not OPT's.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise ConfigError(f"model path {path} does not exist")
    folder = path if path.is_dir() else path.parent
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or any(f.suffix != ".safetensors" for f in files):
        raise ConfigError(
            f"model path {path}: expected a folder with config.json and *.safetensors, or a "
            ".safetensors file (pickled .bin checkpoints are not loaded)"
        )
    if arch is None:
        arch = _read_config(folder / "config.json", name=path.name)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            raw = load_file(str(file), device=str(device))
        except Exception as error:  # safetensors raises its own SafetensorError and OSError
            raise ConfigError(f"cannot read {file}: {error}") from None
        for name, tensor in raw.items():
            tensors[_canonical(name)] = tensor.to(dtype)
    unknown = sorted(set(tensors) - set(parameter_shapes(arch)) - {_LM_HEAD})
    if unknown:
        shown = ", ".join(unknown[:4]) + (" ..." if len(unknown) > 4 else "")
        raise ConfigError(
            f"model path {path}: {len(unknown)} tensors are not OPT parameters of {arch.name} "
            f"({shown}); is this an OPT checkpoint of this size?"
        )
    head = tensors.get(_LM_HEAD)
    if head is not None and tuple(head.shape) != (arch.vocab_size, arch.embed_dim):
        raise ConfigError(f"model path {path}: lm_head.weight has shape {list(head.shape)}")
    return OptWeights(arch, tensors)


def save_checkpoint(
    weights: OptWeights, folder: str | Path, dtype: torch.dtype | None = None
) -> Path:
    """Write ``weights`` as a Hugging Face folder (``config.json`` + ``model.safetensors``).

    The lm_head is tied to the token embedding and not written, as transformers does for OPT.
    Returns the folder.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = weights.arch.to_hf_config()
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    out = {
        f"model.decoder.{name}": (t if dtype is None else t.to(dtype)).detach().contiguous().cpu()
        for name, t in weights.tensors.items()
        if name != _LM_HEAD
    }
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _canonical(name: str) -> str:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _read_config(path: Path, name: str) -> OptArchitecture:
    if not path.is_file():
        raise ConfigError(
            f"{path} not found: a bare safetensors file needs a config.json beside it or a "
            "preset (--preset) that gives its architecture"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"cannot read {path}: {error}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return OptArchitecture.from_hf_config(config, name=name)
