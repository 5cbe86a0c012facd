"""EAGLE-3 drafter: fused low/mid/high target features, one decoder layer, its own head.

Architecture (SafeAILab/EAGLE ``eagle/model/cnets.py``):

* ``fc`` [3*Dt -> d] fuses three target hidden states: the outputs of target
  layers ``(1, L//2 - 1, L - 4)`` (EAGLE collects the *inputs* of layers
  ``2, L//2, L-3``), concatenated low, mid, high. It is applied only to
  target features; deeper draft steps feed the drafter's own output (already
  d-wide) straight back in, so :func:`eagle3_fuse` is separate from
  :func:`eagle3_hidden`.
* one decoder layer whose attention reads the 2d-wide concatenation
  ``[input_layernorm(embed(x_t)); hidden_norm(feature)]`` (q/k/v take 2d
  inputs), with the *un-normed* feature as the residual, then the usual
  post-attention RMSNorm + SwiGLU MLP;
* a final ``norm`` and an own ``lm_head`` over a draft vocabulary of ``Vd``
  tokens; draft id ``i`` is target id ``i + d2t[i]``, and ``t2d`` [V] marks
  the target ids that have a draft id.

The embedding is the target's (passed in, never stored) unless the drafter
was trained at a width other than the target's (``target_hidden_size`` in
its config), in which case it carries its own, ``Eagle3Params.embed``.

Alignment is EAGLE's, as in :mod:`specjax.drafter`: row t consumes token x_t
and the feature at t-1, and its output predicts x_{t+1}.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import DTypeLike

from specjax import checkpoint as ckpt
from specjax import pytree
from specjax.config import ModelConfig
from specjax.drafter import DrafterMismatchError
from specjax.model import (
    KVCache,
    LayerParams,
    attention,
    cache_mask,
    init_cache,
    rms_norm,
    rope_inv_freq,
)
from specjax.vocab.head import Candidates

FORMAT = "specjax-drafter-eagle3"


def eagle3_tap_layers(num_layers: int) -> tuple[int, int, int]:
    """Target layers whose outputs EAGLE-3 fuses, as ``forward_hidden(tap_layers=...)``.

    EAGLE's patched target records the hidden state *entering* layers
    ``2, L//2, L-3``, i.e. the outputs of layers ``1, L//2-1, L-4``.
    """
    taps = (1, num_layers // 2 - 1, num_layers - 4)
    if not 0 <= taps[0] < taps[1] < taps[2] < num_layers:
        raise ValueError(f"EAGLE-3 needs a target with at least 8 layers, got {num_layers}")
    return taps


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """Static EAGLE-3 architecture.

    ``layer`` describes the drafter's own decoder layer (always Llama-style: no
    q/k/v bias, no q/k norm), its RoPE and norm eps; its ``vocab_size`` is the
    *target* vocabulary (the size of ``t2d``) and ``num_layers`` is 1.
    """

    layer: ModelConfig
    draft_vocab_size: int  # Vd, rows of the own LM head
    target_hidden_size: int  # Dt, width of each fused target feature
    own_embed: bool = False  # the drafter carries its own [V, d] embedding

    def check_target(self, cfg: ModelConfig, what: str = "EAGLE-3 drafter") -> None:
        """Refuse a target whose width or vocabulary differs, naming each field."""
        bad = []
        if self.layer.vocab_size != cfg.vocab_size:
            bad.append(f"vocab_size: {what} {self.layer.vocab_size} vs target {cfg.vocab_size}")
        if self.target_hidden_size != cfg.hidden_size:
            bad.append(f"hidden_size: {what} fuses {self.target_hidden_size}-wide features vs "
                       f"target {cfg.hidden_size}")
        if bad:
            raise DrafterMismatchError(
                f"the {what} was built for a different target ({'; '.join(bad)}); use a "
                "drafter trained for this target")

    # The drafter seam (specjax.draft_model.DraftModel).
    kind: ClassVar[str] = "eagle3"

    @property
    def width(self) -> int:
        return self.layer.hidden_size

    def tap_layers(self, target_cfg: ModelConfig) -> tuple[int, ...]:
        return eagle3_tap_layers(target_cfg.num_layers)

    def target_features(self, params: Eagle3Params, hidden: Array,
                        taps: tuple[Array, ...]) -> Array:
        return eagle3_fuse(params, tuple(taps))

    def forward(self, params: Eagle3Params, embed: Array, tokens: Array, features: Array,
                positions: Array, cache: KVCache, block_mask: Array | None = None,
                write_rows: Array | None = None,
                attention_impl: str = "dense") -> tuple[Array, KVCache]:
        return eagle3_hidden(params, self, embed, tokens, features, positions, cache,
                             block_mask, write_rows, attention_impl)

    def init_cache(self, batch: int, capacity: int,
                   dtype: DTypeLike = jnp.float32) -> KVCache:
        return init_eagle3_cache(self, batch, capacity, dtype)

    def router_context(self, embed: Array, tokens: Array, features: Array) -> None:
        return None  # its own draft vocabulary: no router reads its context

    def to_json(self) -> dict:
        return {"layer": self.layer.to_json(), "draft_vocab_size": self.draft_vocab_size,
                "target_hidden_size": self.target_hidden_size, "own_embed": self.own_embed}

    @classmethod
    def from_json(cls, d: dict) -> Eagle3Config:
        return cls(layer=ModelConfig.from_json(d["layer"]),
                   draft_vocab_size=d["draft_vocab_size"],
                   target_hidden_size=d["target_hidden_size"], own_embed=d["own_embed"])


@pytree.dataclass
class Eagle3Params:
    """EAGLE-3 weights; linear weights are [in, out], head and embedding [rows, d]."""

    fc: Array  # [3*Dt, d]; input rows are [low; mid; high]
    embed_norm: Array  # [d] midlayer.input_layernorm, on the token embedding
    hidden_norm: Array  # [d] midlayer.hidden_norm, on the feature
    wq: Array  # [2d, Hq*Dh]; input rows are [embedding; feature]
    wk: Array  # [2d, Hkv*Dh]
    wv: Array  # [2d, Hkv*Dh]
    wo: Array  # [Hq*Dh, d]
    mlp_norm: Array  # [d] midlayer.post_attention_layernorm
    w_gate: Array  # [d, F]
    w_up: Array  # [d, F]
    w_down: Array  # [F, d]
    final_norm: Array  # [d] norm
    lm_head: Array  # [Vd, d]
    d2t: Array  # [Vd] int32 offsets: target id = draft id + d2t[draft id]
    t2d: Array  # [V] bool: target id has a draft id
    embed: Array | None = None  # [V, d] only when cfg.own_embed


FLOAT_FIELDS = tuple(f.name for f in dataclasses.fields(Eagle3Params)
                     if f.name not in ("d2t", "t2d"))


def eagle3_fuse(p: Eagle3Params, taps: tuple[Array, Array, Array] | Array) -> Array:
    """Fuse target features: ([B, T, Dt] x 3, low/mid/high) or [B, T, 3*Dt] -> [B, T, d]."""
    x = jnp.concatenate(taps, axis=-1) if isinstance(taps, tuple | list) else taps
    return x @ p.fc


def _attention_view(p: Eagle3Params) -> LayerParams:
    """The midlayer's attention weights as a LayerParams, for :func:`specjax.model.attention`.

    Its q/k/v projections take the 2d-wide [embedding; feature] input; the
    norms and MLP are applied here, around the shared attention.
    """
    return LayerParams(attn_norm=None, wq=p.wq, wk=p.wk, wv=p.wv, wo=p.wo, mlp_norm=p.mlp_norm,
                       w_gate=p.w_gate, w_up=p.w_up, w_down=p.w_down)


def eagle3_hidden(p: Eagle3Params, cfg: Eagle3Config, embed: Array | None, tokens: Array,
                  features: Array, positions: Array, cache: KVCache,
                  block_mask: Array | None = None,
                  write_rows: Array | None = None,
                  attention_impl: str = "dense") -> tuple[Array, KVCache]:
    """Drafter output features (before the final norm) for a block of new rows.

    Args:
      embed: [V, d] the target's embedding; ignored (may be None) when the
        drafter has its own (``cfg.own_embed``).
      tokens: [B, T] x_t.
      features: [B, T, d] the feature at t-1: :func:`eagle3_fuse` of the
        target's taps, or the drafter's own previous output when drafting.
      positions: [B, T] RoPE positions; cache: from :func:`init_eagle3_cache`.
      block_mask, write_rows, attention_impl: as in :func:`specjax.model.forward_hidden`.
    Returns:
      (hidden [B, T, d], cache with the new rows written; lengths unchanged).
      :func:`eagle3_candidates` turns hidden into draft logits.
    """
    lc = cfg.layer
    if features.shape[-1] != lc.hidden_size:
        raise ValueError(f"features are {features.shape[-1]}-wide, the drafter is "
                         f"{lc.hidden_size}-wide; fuse target taps with eagle3_fuse first")
    table = p.embed if p.embed is not None else embed
    b, t = tokens.shape
    e = table[tokens].astype(features.dtype)
    h = jnp.concatenate([rms_norm(e, p.embed_norm, lc.rms_norm_eps),
                         rms_norm(features, p.hidden_norm, lc.rms_norm_eps)], axis=-1)
    if block_mask is None:
        block_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    if write_rows is None:
        write_rows = cache.lengths[:, None] + jnp.arange(t)[None, :]
    mask = cache_mask(cache.lengths, block_mask, cache.capacity)
    attn, k, v = attention(lc, _attention_view(p), h, positions, rope_inv_freq(lc), cache.k[0],
                           cache.v[0], write_rows, mask, (cache.lengths, block_mask),
                           attention_impl)
    # The residual stream is the un-normed feature, not the concatenation.
    x = features + attn
    m = rms_norm(x, p.mlp_norm, lc.rms_norm_eps)
    x = x + (jax.nn.silu(m @ p.w_gate) * (m @ p.w_up)) @ p.w_down
    return x, dataclasses.replace(cache, k=(k,), v=(v,))


def draft_to_target(p: Eagle3Params, draft_ids: Array) -> Array:
    """Map draft-vocabulary ids [...] to target ids [...]."""
    return draft_ids + p.d2t[draft_ids]


def eagle3_candidates(p: Eagle3Params, cfg: Eagle3Config, hidden: Array) -> tuple[Array, Array]:
    """The drafter's shortlist: (target_ids [..., Vd] int32, logits [..., Vd] fp32).

    ``logits[..., i]`` scores target token ``target_ids[..., i]``; the ids are
    the same for every row (the static EAGLE-3 draft vocabulary).
    """
    cand = Eagle3Head.of(p, cfg)(None, hidden, 0)
    return cand.ids, cand.logits


@pytree.dataclass
class Eagle3Head:
    """An EAGLE-3 drafter's own head as a :class:`~specjax.vocab.head.VocabHead`: its final
    norm and LM head over the Vd-token draft vocabulary, scored in target ids.

    final_norm: [d]; lm_head: [Vd, d]; ids: [Vd] int32 the target id of each draft id.
    It ignores the target's LM head (``w``): the drafter was trained with its own.
    """

    final_norm: Array
    lm_head: Array
    ids: Array
    eps: float = pytree.static_field()
    name: ClassVar[str] = "eagle3"
    uses_context: ClassVar[bool] = False
    stateful: ClassVar[bool] = False

    @classmethod
    def of(cls, p: Eagle3Params, cfg: Eagle3Config) -> Eagle3Head:
        ids = jnp.arange(cfg.draft_vocab_size, dtype=jnp.int32) + p.d2t.astype(jnp.int32)
        return cls(p.final_norm, p.lm_head, ids, cfg.layer.rms_norm_eps)

    def capacity(self, step: int) -> int:
        return self.ids.shape[0]

    def __call__(self, w: Array | None, h: Array, step: int,
                 context: Array | None = None, state: None = None) -> Candidates:
        logits = jnp.einsum("...d,vd->...v", rms_norm(h, self.final_norm, self.eps),
                            self.lm_head, preferred_element_type=jnp.float32)
        return Candidates(jnp.broadcast_to(self.ids, logits.shape),
                          jnp.ones(logits.shape, bool), logits)


def init_eagle3_cache(cfg: Eagle3Config, batch: int, capacity: int,
                      dtype: DTypeLike = jnp.float32) -> KVCache:
    """The drafter's own one-layer KV cache."""
    return init_cache(dataclasses.replace(cfg.layer, num_layers=1, layer_types=()), batch,
                      capacity, dtype)


def check_vocab_map(d2t: np.ndarray, t2d: np.ndarray, vocab_size: int,
                    source: str = "EAGLE-3 drafter") -> None:
    """Refuse a d2t/t2d pair that is not a one-to-one draft -> target vocabulary map.

    Raises ValueError naming the first offending draft id; callers wrap it in
    their own error type.
    """
    d2t, t2d = np.asarray(d2t), np.asarray(t2d)
    if t2d.shape != (vocab_size,):
        raise ValueError(f"{source}: t2d has shape {t2d.shape}, expected ({vocab_size},) "
                         "(one flag per target token)")
    target = np.arange(d2t.shape[0], dtype=np.int64) + d2t.astype(np.int64)
    out = np.flatnonzero((target < 0) | (target >= vocab_size))
    if out.size:
        i = int(out[0])
        raise ValueError(f"{source}: d2t maps draft id {i} to target id {int(target[i])}, "
                         f"outside the target vocabulary [0, {vocab_size}) "
                         f"({out.size} draft ids out of range)")
    ids, counts = np.unique(target, return_counts=True)
    if (counts > 1).any():
        tid = int(ids[np.argmax(counts > 1)])
        raise ValueError(f"{source}: d2t maps several draft ids to target id {tid}")
    mask = np.zeros(vocab_size, bool)
    mask[target] = True
    diff = np.flatnonzero(mask != t2d.astype(bool))
    if diff.size:
        raise ValueError(f"{source}: t2d disagrees with d2t at {diff.size} target ids, e.g. "
                         f"{diff[:5].tolist()} (t2d must flag exactly the targets of d2t)")


def save_eagle3(out: Path, cfg: Eagle3Config, p: Eagle3Params, *, meta: dict | None = None,
                overwrite: bool = False) -> Path:
    """Write an EAGLE-3 drafter folder (orbax tensors + manifest, written last); atomic."""
    flat = {f.name: np.asarray(getattr(p, f.name)) for f in dataclasses.fields(p)
            if getattr(p, f.name) is not None}
    flat["d2t"] = flat["d2t"].astype(np.int32)
    flat["t2d"] = flat["t2d"].astype(bool)
    return ckpt.write_checkpoint(out, flat, FORMAT, cfg.to_json(), meta=meta,
                                 overwrite=overwrite)


def read_eagle3(path: Path, target_cfg: ModelConfig | None = None,
                dtype: str | None = None) -> tuple[Eagle3Config, Eagle3Params, dict]:
    """(config, params, meta) of an EAGLE-3 folder; refuses one built for another target.

    ``dtype`` casts the float weights only; d2t / t2d keep their integer / bool types.
    """
    manifest = ckpt.read_manifest(Path(path), FORMAT)
    cfg = Eagle3Config.from_json(manifest["config"])
    if target_cfg is not None:
        cfg.check_target(target_cfg)
    flat = ckpt.restore_params(Path(path), manifest)
    if dtype is not None:
        flat = {k: (v.astype(jnp.dtype(dtype)) if k in FLOAT_FIELDS else v)
                for k, v in flat.items()}
    return cfg, Eagle3Params(**flat), manifest["meta"]


# HF (cnets.py) tensor name -> (Eagle3Params field, transposed). Linear weights
# are [out, in] in torch and [in, out] here.
HF_NAMES: dict[str, tuple[str, bool]] = {
    "fc.weight": ("fc", True),
    "midlayer.input_layernorm.weight": ("embed_norm", False),
    "midlayer.hidden_norm.weight": ("hidden_norm", False),
    "midlayer.self_attn.q_proj.weight": ("wq", True),
    "midlayer.self_attn.k_proj.weight": ("wk", True),
    "midlayer.self_attn.v_proj.weight": ("wv", True),
    "midlayer.self_attn.o_proj.weight": ("wo", True),
    "midlayer.post_attention_layernorm.weight": ("mlp_norm", False),
    "midlayer.mlp.gate_proj.weight": ("w_gate", True),
    "midlayer.mlp.up_proj.weight": ("w_up", True),
    "midlayer.mlp.down_proj.weight": ("w_down", True),
    "norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", False),
    "d2t": ("d2t", False),
    "t2d": ("t2d", False),
    "embed_tokens.weight": ("embed", False),
}


def hf_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF-form EAGLE-3 checkpoint of ``cfg`` holds, in HF layout.

    ``embed_tokens.weight`` is listed only when the drafter has its own embedding.
    """
    lc = cfg.layer
    d, f = lc.hidden_size, lc.intermediate_size
    q, kv = lc.num_heads * lc.head_dim, lc.num_kv_heads * lc.head_dim
    shapes = {
        "fc.weight": (d, 3 * cfg.target_hidden_size),
        "midlayer.input_layernorm.weight": (d,), "midlayer.hidden_norm.weight": (d,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * d),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * d),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * d),
        "midlayer.self_attn.o_proj.weight": (d, q),
        "midlayer.post_attention_layernorm.weight": (d,),
        "midlayer.mlp.gate_proj.weight": (f, d), "midlayer.mlp.up_proj.weight": (f, d),
        "midlayer.mlp.down_proj.weight": (d, f),
        "norm.weight": (d,), "lm_head.weight": (cfg.draft_vocab_size, d),
        "d2t": (cfg.draft_vocab_size,), "t2d": (lc.vocab_size,),
    }
    if cfg.own_embed:
        shapes["embed_tokens.weight"] = (lc.vocab_size, d)
    return shapes


def params_from_hf_state(state: dict[str, np.ndarray],
                         dtype: DTypeLike = np.float32) -> Eagle3Params:
    """Map a checked HF-named state dict (see :func:`hf_shapes`) onto Eagle3Params."""
    fields = {}
    for name, (field, transpose) in HF_NAMES.items():
        if name not in state:
            continue
        a = np.asarray(state[name])
        if field == "d2t":
            fields[field] = a.astype(np.int32)
        elif field == "t2d":
            fields[field] = a.astype(bool)
        else:
            fields[field] = np.ascontiguousarray(a.T if transpose else a).astype(dtype)
    return Eagle3Params(**fields)


def export_eagle3_state(p: Eagle3Params) -> dict[str, np.ndarray]:
    """The HF-form (cnets.py) state dict: float32 weights, d2t int64, t2d bool.

    The inverse of the import: equal to the imported state dict minus an
    ``embed_tokens.weight`` copy of the target's embedding (never stored).
    """
    state = {}
    for name, (field, transpose) in HF_NAMES.items():
        v = getattr(p, field)
        if v is None:
            continue
        a = np.asarray(v)
        if field == "d2t":
            state[name] = a.astype(np.int64)
        elif field == "t2d":
            state[name] = a.astype(bool)
        else:
            state[name] = np.ascontiguousarray(a.T if transpose else a).astype(np.float32)
    return state
