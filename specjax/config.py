"""Static model configuration, read from a Hugging Face ``config.json``.

Gemma 3 norms: HF stores each RMSNorm weight ``w`` and scales by ``1 + w``; specjax stores
the multiplier ``1 + w`` itself (as llama.cpp's GGUF files do), so one RMSNorm serves every
family. ``norm_plus_one`` records that the converter added the 1 and that the scale is
applied in float32 before the cast back, as transformers' ``Gemma3RMSNorm`` does.

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
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "gemma3_text")

# Gemma 3's per-layer attention kinds (HF ``layer_types``).
SLIDING, FULL = "sliding_attention", "full_attention"
# MLP activations: SiLU (SwiGLU) and the tanh-approximated GELU (GeGLU, Gemma).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


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
    """Architecture of a decoder-only Llama/Qwen2/Qwen3/Gemma 3 (text) model.

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
    # Gemma 3 (all defaults are the Llama behaviour, so older manifests load unchanged).
    hidden_act: str = "silu"  # one of ACTIVATIONS
    scale_embeddings: bool = False  # embedding rows times sqrt(hidden_size)
    sandwich_norms: bool = False  # RMSNorm on the attention and MLP outputs too
    norm_plus_one: bool = False  # norm weights are stored as 1 + w (see the module doc)
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this), else 1/sqrt(Dh)
    # Per-layer SLIDING or FULL; () means every layer is FULL. A SLIDING layer's query at
    # position p sees keys at positions k with p - k < sliding_window (transformers'
    # ``sliding_window_overlay``: kv_idx > q_idx - window), besides causality.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local_theta: float | None = None  # RoPE base of SLIDING layers
    rope_linear_factor: float | None = None  # "linear" RoPE scaling of FULL layers

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
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"hidden_act {self.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types:
            bad = sorted(set(self.layer_types) - {SLIDING, FULL})
            if bad:
                raise UnsupportedModelError(
                    f"layer_types {bad} are not supported; specjax implements {SLIDING!r} "
                    f"and {FULL!r} layers")
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                                 f"num_layers={self.num_layers}")
        if SLIDING in self.layer_types and not (
                isinstance(self.sliding_window, int) and self.sliding_window >= 1):
            raise ValueError(f"sliding_window must be a positive integer when some layer is "
                             f"{SLIDING!r}, got {self.sliding_window!r}")
        for name in ("query_pre_attn_scalar", "rope_local_theta", "rope_linear_factor"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real)
                                  or not (math.isfinite(v) and v > 0)):
                raise ValueError(f"{name} must be a finite number > 0 or null, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def attn_scale(self) -> float:
        """The factor on q . k: 1/sqrt(query_pre_attn_scalar) for Gemma, else 1/sqrt(Dh)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_sliding(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` attends through the sliding window."""
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING

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
        if model_type == "gemma3":
            raise UnsupportedModelError(
                "model_type 'gemma3' is the multimodal Gemma 3 (vision tower + text_config); "
                "specjax converts the text-only 'gemma3_text' checkpoints (Gemma3ForCausalLM, "
                "e.g. gemma-3-270m or a GGUF). Save the language model alone with transformers "
                "(`Gemma3ForCausalLM`) and convert that folder")
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
        if model_type == "gemma3_text":
            return cls(**_common_fields(hf), **_gemma3_fields(hf))
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {hf['hidden_act']!r} is not supported (silu)")
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
        return cls(
            **_common_fields(hf),
            rope_theta=float(rope_theta),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bias,
            qk_norm=model_type == "qwen3",
            rope_scaling=scaling,
        )

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["layer_types"] = list(self.layer_types)
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
        types = d.get("layer_types", ())
        if not isinstance(types, list | tuple) or not all(isinstance(t, str) for t in types):
            raise ValueError(f"config field layer_types must be a list of strings, got {types!r}")
        d["layer_types"] = tuple(types)
        return cls(**d)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        with open(Path(path) / "config.json") as f:
            return cls.from_hf(json.load(f))


def _eos_ids(hf: dict[str, Any]) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos_ids):
        raise ValueError(f"eos_token_id must be an int or a list of ints, got {eos!r}")
    return tuple(int(e) for e in eos_ids)


def _common_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The fields every family reads the same way from an HF config."""
    heads = hf["num_attention_heads"]
    return dict(
        model_type=hf["model_type"], vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        bos_token_id=hf.get("bos_token_id"), eos_token_ids=_eos_ids(hf))


def _gemma3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 text (``Gemma3TextConfig``): its features, and refusals of what specjax lacks.

    Reads both config.json forms transformers writes: v5's ``rope_parameters`` keyed by
    layer type, and v4's ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` /
    ``sliding_window_pattern``. Defaults are ``Gemma3TextConfig``'s.
    """
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(name) is not None:
            raise UnsupportedModelError(
                f"{name}={hf[name]} is not supported: specjax does not implement tanh "
                "soft-capping (Gemma 3 checkpoints set it to null)")
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention=True is not supported; "
                                    "specjax runs causal decoders only")
    if hf.get("attention_bias"):
        raise UnsupportedModelError("attention_bias=True is not supported for gemma3_text "
                                    "(it would add a bias to o_proj too)")
    act = hf.get("hidden_activation", hf.get("hidden_act")) or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"hidden_activation {act!r} is not supported for "
                                    "gemma3_text (gelu_pytorch_tanh)")
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(f"sliding_window_pattern must be a positive integer, got "
                             f"{pattern!r}")
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ValueError(f"layer_types must be a list of strings, got {types!r}")
    rope = hf.get("rope_parameters")
    if rope is not None and not (isinstance(rope, dict) and set(rope) <= {SLIDING, FULL}):
        raise UnsupportedModelError(f"rope_parameters {rope!r} is not keyed by layer type "
                                    f"({SLIDING!r}, {FULL!r}); this RoPE layout is not "
                                    "supported for gemma3_text")
    rope = rope or {}
    full = dict(rope.get(FULL) or hf.get("rope_scaling") or {})
    local = dict(rope.get(SLIDING) or {})
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    kind = local.get("rope_type", local.get("type", "default"))
    if kind != "default":
        raise UnsupportedModelError(f"rope_type {kind!r} on {SLIDING} layers is not supported "
                                    "(default)")
    kind = full.get("rope_type", full.get("type", "default"))
    if kind not in ("default", "linear"):
        raise UnsupportedModelError(f"rope_type {kind!r} on {FULL} layers is not supported "
                                    "for gemma3_text (default, linear)")
    return dict(
        rope_theta=float(full["rope_theta"]),
        rope_local_theta=float(local["rope_theta"]),
        rope_linear_factor=float(full["factor"]) if kind == "linear" else None,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        qk_norm=True, hidden_act=act, scale_embeddings=True, sandwich_norms=True,
        norm_plus_one=True, query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        layer_types=tuple(types),
        sliding_window=hf.get("sliding_window", 4096) if SLIDING in types else None)


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
