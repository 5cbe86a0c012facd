"""Static model configuration, read from a Hugging Face ``config.json``.

A :class:`ModelConfig` is frozen and hashable, so it can be a static argument
of ``jax.jit``: two models with equal configs share compiled code.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# HF ``model_type`` values and the features each implies. The forward pass is
# one function; the families differ only by these flags.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


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
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from the dict of an HF ``config.json``; refuses what it cannot run."""
        model_type = hf.get("model_type")
        archs = hf.get("architectures") or []
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} (architectures {archs}) is not supported; "
                f"specjax converts {', '.join(SUPPORTED_MODEL_TYPES)} checkpoints."
            )
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
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        with open(Path(path) / "config.json") as f:
            return cls.from_hf(json.load(f))
