"""Hugging Face Llama/Qwen/Gemma 3 state dicts to :class:`specjax.model.Params`.

HF stores linear weights as ``[out, in]``; specjax keeps ``[in, out]`` so a
projection is ``x @ w``. Embedding and LM head stay ``[V, d]``. Gemma 3's norm weights
``w`` become the multipliers ``1 + w`` (``ModelConfig.norm_plus_one``), and its four
per-layer norms map as input -> ``attn_norm``, post_attention -> ``post_attn_norm``,
pre_feedforward -> ``mlp_norm``, post_feedforward -> ``post_mlp_norm`` (in Llama's
naming ``post_attention_layernorm`` is the pre-MLP norm).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from jax.typing import DTypeLike
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from specjax.checkpoint import CheckpointError
from specjax.config import ModelConfig
from specjax.model import LayerParams, Params


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of ``cfg`` must hold, in HF layout."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        }
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (cfg.head_dim,),
                       p + "self_attn.k_norm.weight": (cfg.head_dim,)}
        if cfg.sandwich_norms:
            shapes |= {p + "pre_feedforward_layernorm.weight": (d,),
                       p + "post_feedforward_layernorm.weight": (d,)}
    return shapes


def check_state(cfg: ModelConfig, state: dict[str, np.ndarray], source: str) -> None:
    """Refuse missing, extra or mis-shaped tensors, naming each."""
    want = expected_shapes(cfg)
    have = dict(state)
    # Tied checkpoints sometimes still carry a copy of the head: it must equal the embedding.
    if cfg.tie_word_embeddings and "lm_head.weight" in have:
        head = have.pop("lm_head.weight")
        if not np.array_equal(head, have.get("model.embed_tokens.weight")):
            raise CheckpointError(
                f"{source}: tie_word_embeddings=true but lm_head.weight differs from "
                "model.embed_tokens.weight; fix tie_word_embeddings in config.json")
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    if missing:
        raise CheckpointError(f"{source}: {len(missing)} tensors missing from the checkpoint, "
                              f"e.g. {missing[:5]}; is it complete and does config.json match it?")
    if extra:
        raise CheckpointError(f"{source}: {len(extra)} unexpected tensors, e.g. {extra[:5]}; "
                              "the checkpoint does not match config.json (wrong layer count, "
                              "architecture or an unsupported feature)")
    bad = [f"{k}: {tuple(have[k].shape)} != {v}" for k, v in want.items()
           if tuple(have[k].shape) != v]
    if bad:
        raise CheckpointError(f"{source}: shape mismatch against config.json: {bad[:5]}")


def iter_safetensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, fp32 array) over every ``*.safetensors`` shard in ``path``."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files; specjax converts safetensors "
                              "checkpoints (re-save with `model.save_pretrained(dir)`)")
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        absent = sorted(s for s in shards if not (path / s).exists())
        if absent:
            raise CheckpointError(f"{path}: shards listed in model.safetensors.index.json are "
                                  f"missing: {absent}")
    for file in files:
        try:
            with safe_open(file, framework="flax") as f:
                for name in f.keys():
                    yield name, to_f32(f, name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: cannot read safetensors ({e}); the file is truncated "
                                  "or corrupt, download it again") from e


def to_f32(f: Any, name: str) -> np.ndarray:
    # The numpy framework cannot represent bfloat16; the flax one can (ml_dtypes).
    return np.asarray(f.get_tensor(name), dtype=np.float32)


def load_hf_state(path: Path, progress: bool = True) -> dict[str, np.ndarray]:
    """All tensors of an HF folder as fp32 numpy arrays."""
    state = {}
    for name, arr in tqdm(iter_safetensors(path), desc="read safetensors", unit="tensor",
                          disable=not progress):
        state[name] = arr
    return state


def _norm_weight(w: np.ndarray, cfg: ModelConfig | None, dtype) -> np.ndarray:
    """A norm weight as specjax stores it: ``1 + w`` (added in fp32) for Gemma 3."""
    w = np.asarray(w, np.float32)
    return (w + 1.0 if cfg is not None and cfg.norm_plus_one else w).astype(dtype)


def layer_from_hf(state: dict[str, np.ndarray], prefix: str, dtype: DTypeLike = np.float32,
                  cfg: ModelConfig | None = None) -> LayerParams:
    """One decoder layer from HF names under ``prefix`` (e.g. "model.layers.3.").

    Linear weights are transposed to [in, out]; tensors the state lacks (biases,
    q/k norms, an EAGLE-1 layer's input norm) become None. Callers check which
    tensors are required before. ``cfg`` (when given) selects Gemma 3's norm names and
    its ``1 + w`` norm weights.
    """
    def get(name: str, transpose: bool = False) -> np.ndarray | None:
        a = state.get(prefix + name)
        return None if a is None else np.ascontiguousarray(a.T if transpose else a).astype(dtype)

    def norm(name: str) -> np.ndarray | None:
        a = state.get(prefix + name)
        return None if a is None else _norm_weight(a, cfg, dtype)

    a = "self_attn."
    sandwich = cfg is not None and cfg.sandwich_norms
    return LayerParams(
        attn_norm=norm("input_layernorm.weight"),
        wq=get(a + "q_proj.weight", True), wk=get(a + "k_proj.weight", True),
        wv=get(a + "v_proj.weight", True), wo=get(a + "o_proj.weight", True),
        mlp_norm=norm("pre_feedforward_layernorm.weight" if sandwich
                      else "post_attention_layernorm.weight"),
        w_gate=get("mlp.gate_proj.weight", True), w_up=get("mlp.up_proj.weight", True),
        w_down=get("mlp.down_proj.weight", True),
        bq=get(a + "q_proj.bias"), bk=get(a + "k_proj.bias"), bv=get(a + "v_proj.bias"),
        q_norm=norm(a + "q_norm.weight"), k_norm=norm(a + "k_norm.weight"),
        post_attn_norm=norm("post_attention_layernorm.weight") if sandwich else None,
        post_mlp_norm=norm("post_feedforward_layernorm.weight") if sandwich else None,
    )


def params_from_hf_state(cfg: ModelConfig, state: dict[str, np.ndarray], source: str,
                         dtype: DTypeLike = np.float32) -> Params:
    """Map a checked HF state dict onto the :class:`Params` pytree (numpy leaves)."""
    check_state(cfg, state, source)

    def get(name: str) -> np.ndarray:
        return np.ascontiguousarray(state[name]).astype(dtype)

    return Params(
        embed=get("model.embed_tokens.weight"),
        layers=tuple(layer_from_hf(state, f"model.layers.{i}.", dtype, cfg)
                     for i in range(cfg.num_layers)),
        final_norm=_norm_weight(state["model.norm.weight"], cfg, dtype),
        lm_head=None if cfg.tie_word_embeddings else get("lm_head.weight"),
    )
