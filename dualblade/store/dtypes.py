"""The KV dtypes a store holds, by name and as torch dtypes: the one table of them.

A config names its dtype as a string (``pipeline`` stays free of torch); everything that makes
or checks tensors maps the name here.
"""

from __future__ import annotations

import torch

from dualblade.errors import ConfigError
from dualblade.pipeline import DType

TORCH_DTYPES: dict[DType, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name.

    Raises:
        ConfigError: not a dtype a store holds.
    """
    try:
        return TORCH_DTYPES[name]  # type: ignore[index]
    except KeyError:
        raise ConfigError(f"dtype must be one of {', '.join(TORCH_DTYPES)}, got {name!r}") from None


def dtype_name(dtype: torch.dtype) -> DType:
    """The name of a torch dtype a store can hold.

    Raises:
        ConfigError: the store holds no such dtype (it holds float16, bfloat16 and float32).
    """
    for name, candidate in TORCH_DTYPES.items():
        if candidate == dtype:
            return name
    raise ConfigError(f"a store holds {', '.join(TORCH_DTYPES)} tensors, not {dtype}")
