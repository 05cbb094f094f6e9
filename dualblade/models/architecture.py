"""The numbers that define an OPT decoder, from a preset or from a checkpoint's ``config.json``.

The pipeline's :class:`~dualblade.pipeline.ModelShape` knows only what sizes the KV cache; running
the model also needs the vocabulary, the feed-forward width, the number of learned positions and
where the LayerNorms sit. OPT-350m is the odd one of the family (post-LayerNorm, and a 512-wide
embedding projected to 1024): both are read from ``config.json`` and run as written there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dualblade.errors import ConfigError
from dualblade.pipeline import DTYPE_BYTES, DType, ModelShape, get_preset

#: OPT's learned positional embedding table starts at index 2 (a fairseq leftover): position p
#: reads row p + 2, so the table has ``max_positions + 2`` rows.
POSITION_OFFSET = 2

#: The OPT family's GPT-2 BPE vocabulary (50265 tokens, padded to a multiple of 8).
OPT_VOCAB = 50272


@dataclass(frozen=True)
class OptArchitecture:
    """One OPT decoder's hyper-parameters; ``kv_dtype`` is the dtype its KV cache is stored in."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_dim: int
    vocab_size: int
    max_positions: int
    layer_norm_before: bool = True
    word_embed_dim: int | None = None
    kv_dtype: DType = "float16"

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "ffn_dim", "vocab_size"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"model {self.name}: {field} must be positive")
        if self.max_positions <= 0:
            raise ConfigError(f"model {self.name}: max_positions must be positive")
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"model {self.name}: hidden_size ({self.hidden_size}) is not a multiple of "
                f"num_heads ({self.num_heads})"
            )
        if self.kv_dtype not in DTYPE_BYTES:
            raise ConfigError(f"model {self.name}: kv dtype must be one of {sorted(DTYPE_BYTES)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def embed_dim(self) -> int:
        """Width of the token embedding (and of the tied lm_head)."""
        return self.word_embed_dim or self.hidden_size

    def shape(self) -> ModelShape:
        """The KV geometry the pipeline plans with (OPT: multi-head attention, no GQA)."""
        return ModelShape(
            self.name,
            self.num_layers,
            self.hidden_size,
            self.num_heads,
            self.num_heads,
            self.head_dim,
            self.kv_dtype,
        )

    @classmethod
    def from_preset(cls, name: str) -> OptArchitecture:
        """An OPT preset of :mod:`dualblade.pipeline.shapes` with the family's usual numbers.

        The feed-forward layer is 4x the hidden size and there are 2048 positions, as in every
        published OPT; ``opt-tiny`` gets a 1024-token vocabulary and 512 positions so that its
        random weights are a few hundred kilobytes. OPT-350m's projection and post-LayerNorm are
        not in the presets: load its ``config.json`` to run it faithfully.

        Raises:
            ConfigError: no such preset, or a preset of another family (Llama, Qwen).
        """
        shape = get_preset(name)
        if not shape.name.startswith("opt-"):
            raise ConfigError(
                f"preset {name!r} is not an OPT model; `generate` runs the OPT family "
                "(for other decoders use the transformers cache, DualBladeCache)"
            )
        tiny = shape.name == "opt-tiny"
        return cls(
            name=shape.name,
            num_layers=shape.num_layers,
            hidden_size=shape.hidden_size,
            num_heads=shape.num_heads,
            ffn_dim=4 * shape.hidden_size,
            vocab_size=1024 if tiny else OPT_VOCAB,
            max_positions=512 if tiny else 2048,
            kv_dtype=shape.dtype,
        )

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], name: str = "checkpoint") -> OptArchitecture:
        """Read a Hugging Face ``OPTConfig`` dict (``config.json``).

        Raises:
            ConfigError: not an OPT config, a missing field, or an activation other than ReLU.
        """
        model_type = config.get("model_type", "opt")
        if model_type != "opt":
            raise ConfigError(f"{name}: model_type is {model_type!r}; only 'opt' checkpoints run")
        activation = config.get("activation_function", "relu")
        if activation != "relu":
            raise ConfigError(f"{name}: activation_function {activation!r}; OPT uses 'relu'")
        try:
            hidden = int(config["hidden_size"])
            dtype = str(config.get("torch_dtype") or config.get("dtype") or "float16")
            word_dim = int(config.get("word_embed_proj_dim") or hidden)
            return cls(
                name=name,
                num_layers=int(config["num_hidden_layers"]),
                hidden_size=hidden,
                num_heads=int(config["num_attention_heads"]),
                ffn_dim=int(config["ffn_dim"]),
                vocab_size=int(config["vocab_size"]),
                max_positions=int(config.get("max_position_embeddings", 2048)),
                layer_norm_before=bool(config.get("do_layer_norm_before", True)),
                word_embed_dim=None if word_dim == hidden else word_dim,
                kv_dtype=dtype if dtype in DTYPE_BYTES else "float16",  # type: ignore[arg-type]
            )
        except KeyError as missing:
            raise ConfigError(f"{name}: config.json lacks {missing.args[0]!r}") from None
        except (TypeError, ValueError) as error:
            raise ConfigError(f"{name}: config.json has a bad value: {error}") from None

    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` that :meth:`from_hf_config` (and transformers' OPTConfig) reads."""
        return {
            "model_type": "opt",
            "architectures": ["OPTForCausalLM"],
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "ffn_dim": self.ffn_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_positions,
            "do_layer_norm_before": self.layer_norm_before,
            "word_embed_proj_dim": self.embed_dim,
            "activation_function": "relu",
            "enable_bias": True,
            "layer_norm_elementwise_affine": True,
            "tie_word_embeddings": True,
            "torch_dtype": self.kv_dtype,
            "pad_token_id": 1,
            "bos_token_id": 2,
            "eos_token_id": 2,
        }
