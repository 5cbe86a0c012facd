"""Static model configuration, read from a Hugging Face ``config.json``.

A :class:`ModelConfig` is frozen and hashable, so it can be a static argument
of ``jax.jit``: two models with equal configs share compiled code.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from pathlib import Path
from typing import Any

# HF ``model_type`` values and the features each implies. The forward pass is
# one function; the families differ only by these flags.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


# Fields that must be positive integers (sizes and counts).
POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                       "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings")


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture specjax does not implement."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (``rope_type="llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only Llama/Qwen2/Qwen3 model.

    All fields are Python scalars so the config is hashable and jit-static.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections.
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k.
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not supported; specjax implements "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}."
            )
        # Sizes are checked here, once, so a hand-edited or corrupt config fails with the
        # field's name instead of a ZeroDivisionError or a shape error deep in a matmul.
        for name in POSITIVE_INT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
            object.__setattr__(self, name, int(v))
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (
                    math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from the dict of an HF ``config.json``; refuses what it cannot run.

        Raises ValueError (:class:`UnsupportedModelError` for an architecture specjax does
        not implement) naming the field that is missing, mistyped or unsupported.
        """
        if not isinstance(hf, dict):
            raise ValueError(f"config must be a JSON object, got {type(hf).__name__}")
        try:
            return cls._from_hf(hf)
        except KeyError as e:
            raise ValueError(f"config lacks the required field {e.args[0]!r}") from e
        except (TypeError, AttributeError) as e:  # e.g. a string where a number belongs
            raise ValueError(f"config has a field of the wrong type ({e})") from e

    @classmethod
    def _from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        model_type = hf.get("model_type")
        archs = hf.get("architectures") or []
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} (architectures {archs}) is not supported; "
                f"specjax converts {', '.join(SUPPORTED_MODEL_TYPES)} checkpoints."
            )
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ValueError(f"architectures must be a list of class names, got {archs!r}")
        bad_arch = [a for a in archs if not a.endswith("ForCausalLM")]
        if bad_arch:
            raise UnsupportedModelError(
                f"architectures {bad_arch} are not decoder-only causal LMs; expected *ForCausalLM."
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {hf['hidden_act']!r} is not supported (silu)")
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        if model_type == "qwen2":
            bias = True
        else:
            bias = bool(hf.get("attention_bias", False))
        if hf.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=True is not supported")
        if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
            raise UnsupportedModelError(
                "use_sliding_window=True is not supported; specjax uses full attention only"
            )
        rope_params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        rope_theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope_params["factor"]),
                low_freq_factor=float(rope_params["low_freq_factor"]),
                high_freq_factor=float(rope_params["high_freq_factor"]),
                original_max_position_embeddings=int(
                    rope_params["original_max_position_embeddings"]
                ),
            )
        elif rope_type not in (None, "default"):
            raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos_ids):
            raise ValueError(f"eos_token_id must be an int or a list of ints, got {eos!r}")
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bias,
            qk_norm=model_type == "qwen3",
            rope_scaling=scaling,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ModelConfig:
        """Inverse of :meth:`to_json`; ValueError names a missing, unknown or mistyped field."""
        if not isinstance(d, dict):
            raise ValueError(f"config must be a JSON object, got {type(d).__name__}")
        d = dict(d)
        _check_fields(cls, d, "config")
        if d.get("rope_scaling") is not None:
            if not isinstance(d["rope_scaling"], dict):
                raise ValueError("config field rope_scaling must be an object or null")
            _check_fields(RopeScaling, d["rope_scaling"], "config rope_scaling")
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        eos = d.get("eos_token_ids", ())
        if not isinstance(eos, list | tuple) or not all(
                isinstance(e, int) and not isinstance(e, bool) for e in eos):
            raise ValueError(f"config field eos_token_ids must be a list of ints, got {eos!r}")
        d["eos_token_ids"] = tuple(eos)
        return cls(**d)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        with open(Path(path) / "config.json") as f:
            return cls.from_hf(json.load(f))


def _check_fields(cls: type, d: dict[str, Any], what: str) -> None:
    """Refuse keys ``cls`` does not have, and missing required ones, naming them."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ValueError(f"{what} has unknown fields {unknown}")
    missing = sorted(n for n, f in fields.items() if n not in d
                     and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if missing:
        raise ValueError(f"{what} lacks the required fields {missing}")
