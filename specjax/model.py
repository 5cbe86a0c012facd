"""Llama / Qwen2 / Qwen3 / Gemma 3 decoder as pure functions over pytrees.

Layout conventions (the converters in ``specjax.convert`` produce these):

* linear weights are ``[in, out]`` so a projection is ``x @ w``;
* stored (and trained) layers keep Q, K, V and gate, up as separate matrices
  (:class:`LayerParams`); :func:`fuse_params` concatenates them for inference
  (:class:`FusedLayerParams`), so a layer runs one Q/K/V and one gate/up product,
  as production engines store them; the forward pass takes either form;
* the embedding and the LM head are ``[V, d]``: a vocabulary entry is a
  contiguous row, which is what the shortlist heads gather;
* the KV cache is preallocated, one ``[B, S, Hkv, Dh]`` buffer per layer, and
  ``lengths[b]`` rows of batch row ``b`` are committed.

The forward pass takes explicit positions and a mask over the block of new
tokens, so the same function runs a prefill, one decode step, or a draft tree.

Gemma 3 is the same forward with the config's feature flags: embeddings scaled by
sqrt(d), sandwich norms (RMSNorm on the attention and MLP outputs before each residual
add), GeGLU, q/k norms, ``query_pre_attn_scalar``, and sliding-window (local) layers
with their own RoPE base. The cache stays full length on every layer: a local layer's
window is a mask on positions (:func:`specjax.kernels.tree_attention.window_visible`),
so a prefill, a decode step and a tree node near the window's edge see exactly the keys
transformers' masks give them.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import Array
from jax.typing import DTypeLike

from specjax import pytree
from specjax.config import ModelConfig
from specjax.kernels.cpu_attention import cache_attention, env_scores, use_cpu_attention
from specjax.kernels.cpu_rowdot import head_product, out_major_product
from specjax.kernels.tree_attention import tree_attention, window_visible
from specjax.sharding import attend_by_heads, constrain_logits


@pytree.dataclass
class LayerParams:
    attn_norm: Array  # [d]
    wq: Array  # [d, Hq*Dh]
    wk: Array  # [d, Hkv*Dh]
    wv: Array  # [d, Hkv*Dh]
    wo: Array  # [Hq*Dh, d]
    mlp_norm: Array  # [d]
    w_gate: Array  # [d, F]
    w_up: Array  # [d, F]
    w_down: Array  # [F, d]
    bq: Array | None = None  # [Hq*Dh], Qwen2
    bk: Array | None = None  # [Hkv*Dh]
    bv: Array | None = None  # [Hkv*Dh]
    q_norm: Array | None = None  # [Dh], Qwen3
    k_norm: Array | None = None  # [Dh]
    post_attn_norm: Array | None = None  # [d], Gemma 3: on the attention output
    post_mlp_norm: Array | None = None  # [d], Gemma 3: on the MLP output


@pytree.dataclass
class FusedLayerParams:
    """A decoder layer as inference runs it: one [d, q + 2 kv] product for Q/K/V and one
    [d, 2F] product for gate/up (fewer, larger matrix products stream the weights faster
    on XLA:CPU than five separate ones; see docs/benchmarks.md, issue 10).

    ``wq``, ``wk``, ``wv``, ``w_gate``, ``w_up`` (and the biases) are still readable, as
    slices, for code written against :class:`LayerParams` (e.g. a drafter initialised from
    the target's last layer).
    """

    attn_norm: Array | None  # [d]
    wqkv: Array  # [d, q_dim + 2 * kv_dim]: [wq | wk | wv]
    wo: Array  # [q_dim, d]
    mlp_norm: Array  # [d]
    w_gate_up: Array  # [d, 2F]: [w_gate | w_up]
    w_down: Array  # [F, d]
    bqkv: Array | None = None  # [q_dim + 2 * kv_dim], Qwen2
    q_norm: Array | None = None  # [Dh], Qwen3
    k_norm: Array | None = None
    post_attn_norm: Array | None = None  # [d], Gemma 3
    post_mlp_norm: Array | None = None  # [d], Gemma 3
    q_dim: int = pytree.static_field(default=0)  # Hq * Dh
    kv_dim: int = pytree.static_field(default=0)  # Hkv * Dh
    # True: wqkv, wo, w_gate_up and w_down are stored transposed, [out, in], the layout the
    # CPU rowdot kernel streams (:func:`to_out_major`); the properties below still read
    # [in, out].
    out_major: bool = pytree.static_field(default=False)

    def _in_out(self, w: Array) -> Array:
        return w.T if self.out_major else w

    def _qkv(self, x: Array | None, i: int) -> Array | None:
        if x is None:
            return None
        cuts = (0, self.q_dim, self.q_dim + self.kv_dim, self.q_dim + 2 * self.kv_dim)
        return x[..., cuts[i]:cuts[i + 1]]

    wq = property(lambda self: self._qkv(self._in_out(self.wqkv), 0))
    wk = property(lambda self: self._qkv(self._in_out(self.wqkv), 1))
    wv = property(lambda self: self._qkv(self._in_out(self.wqkv), 2))
    bq = property(lambda self: self._qkv(self.bqkv, 0))
    bk = property(lambda self: self._qkv(self.bqkv, 1))
    bv = property(lambda self: self._qkv(self.bqkv, 2))
    w_gate = property(lambda self: jnp.split(self._in_out(self.w_gate_up), 2, axis=1)[0])
    w_up = property(lambda self: jnp.split(self._in_out(self.w_gate_up), 2, axis=1)[1])

    def project(self, name: str, x: Array) -> Array:
        """``x @ w`` for the stored product ``name`` ([..., in] -> [..., out]), through the
        CPU rowdot kernel when the layer is out-major."""
        return stored_product(x, getattr(self, name), self.out_major)


def stored_product(x: Array, w: Array, out_major: bool) -> Array:
    """``x`` [..., in] times a weight stored [in, out], or [out, in] when ``out_major``
    (:func:`to_out_major`, the CPU rowdot kernel's layout) -> [..., out]."""
    return out_major_product(x, w) if out_major else x @ w


def fuse_layer(lp: LayerParams | FusedLayerParams) -> FusedLayerParams:
    """The fused inference form of a layer (unchanged if already fused)."""
    if isinstance(lp, FusedLayerParams):
        return lp
    cat = partial(jnp.concatenate, axis=-1)
    return FusedLayerParams(
        attn_norm=lp.attn_norm, wqkv=cat([lp.wq, lp.wk, lp.wv]), wo=lp.wo,
        mlp_norm=lp.mlp_norm, w_gate_up=cat([lp.w_gate, lp.w_up]), w_down=lp.w_down,
        bqkv=None if lp.bq is None else cat([lp.bq, lp.bk, lp.bv]), q_norm=lp.q_norm,
        k_norm=lp.k_norm, post_attn_norm=lp.post_attn_norm, post_mlp_norm=lp.post_mlp_norm,
        q_dim=int(lp.wq.shape[1]), kv_dim=int(lp.wk.shape[1]))


def unfuse_layer(lp: LayerParams | FusedLayerParams) -> LayerParams:
    """The stored (training) form of a layer (unchanged if not fused)."""
    if isinstance(lp, LayerParams):
        return lp
    return LayerParams(attn_norm=lp.attn_norm, wq=lp.wq, wk=lp.wk, wv=lp.wv,
                       wo=lp._in_out(lp.wo), mlp_norm=lp.mlp_norm, w_gate=lp.w_gate,
                       w_up=lp.w_up, w_down=lp._in_out(lp.w_down), bq=lp.bq, bk=lp.bk,
                       bv=lp.bv, q_norm=lp.q_norm,
                       k_norm=lp.k_norm, post_attn_norm=lp.post_attn_norm,
                       post_mlp_norm=lp.post_mlp_norm)


@pytree.dataclass
class Params:
    embed: Array  # [V, d]
    layers: tuple[LayerParams | FusedLayerParams, ...]
    final_norm: Array  # [d]
    lm_head: Array | None = None  # [V, d]; None when tied to `embed`.

    @property
    def head(self) -> Array:
        """The LM head as [V, d], whether tied or not."""
        return self.embed if self.lm_head is None else self.lm_head


def fuse_params(params: Params) -> Params:
    """``params`` with every layer in the fused inference form (:class:`FusedLayerParams`).

    The same numbers, concatenated: Q/K/V and gate/up become one matrix product each.
    Checkpoints and training keep :class:`LayerParams`; loading a target for inference
    (:func:`specjax.load`) fuses. Idempotent.
    """
    return dataclasses.replace(params, layers=tuple(fuse_layer(lp) for lp in params.layers))


def to_out_major(params: Params) -> Params:
    """``params`` fused, with the four products of every layer stored [out, in] for the CPU
    rowdot kernel (:mod:`specjax.kernels.cpu_rowdot`): a verify step's 2..16 rows then cost
    little more than one. The same numbers; :func:`unfuse_params` undoes it. Idempotent."""
    return dataclasses.replace(params, layers=tuple(out_major_layer(lp)
                                                    for lp in params.layers))


def out_major_layer(lp: LayerParams | FusedLayerParams) -> FusedLayerParams:
    """One layer fused, its four products stored [out, in] (see :func:`to_out_major`)."""
    lp = fuse_layer(lp)
    if lp.out_major:
        return lp
    return dataclasses.replace(lp, wqkv=lp.wqkv.T, wo=lp.wo.T, w_gate_up=lp.w_gate_up.T,
                               w_down=lp.w_down.T, out_major=True)


def is_out_major(params: Params) -> bool:
    """Whether ``params``' layers are stored [out, in] (:func:`to_out_major`)."""
    return bool(params.layers) and getattr(params.layers[0], "out_major", False)


def unfuse_params(params: Params) -> Params:
    """The inverse of :func:`fuse_params`: every layer as :class:`LayerParams`."""
    return dataclasses.replace(params, layers=tuple(unfuse_layer(lp) for lp in params.layers))


@pytree.dataclass
class KVCache:
    k: tuple[Array, ...]  # per layer [B, S, Hkv, Dh]
    v: tuple[Array, ...]  # per layer [B, S, Hkv, Dh]
    lengths: Array  # [B] int32; rows >= lengths[b] hold no committed entry.

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]


def init_cache(cfg: ModelConfig, batch: int, capacity: int,
               dtype: DTypeLike = jnp.float32) -> KVCache:
    """Zeroed cache with ``capacity`` rows per batch row; all lengths 0."""
    shape = (batch, capacity, cfg.num_kv_heads, cfg.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
    return KVCache(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                   lengths=jnp.zeros((batch,), jnp.int32))


def rms_norm(x: Array, weight: Array, eps: float, scale_fp32: bool = False) -> Array:
    """RMSNorm in fp32. The default casts back before the scale (HF Llama); ``scale_fp32``
    scales in fp32 and then casts (HF Gemma 3, whose ``1 + w`` is the stored ``weight``)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if scale_fp32:
        return (xf * weight.astype(jnp.float32)).astype(x.dtype)
    return weight * xf.astype(x.dtype)


def _norm(cfg: ModelConfig, x: Array, weight: Array) -> Array:
    return rms_norm(x, weight, cfg.rms_norm_eps, cfg.norm_plus_one)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> Array:
    """[Dh/2] inverse frequencies: of a FULL layer (llama3 or linear scaling when
    configured), or with ``local`` of a SLIDING layer (base ``rope_local_theta``, never
    scaled, as transformers' Gemma 3)."""
    dh = cfg.head_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
    if local:
        return inv
    if cfg.rope_linear_factor is not None:
        return inv / cfg.rope_linear_factor
    s = cfg.rope_scaling
    if s is None:
        return inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def apply_rope(x: Array, positions: Array, inv_freq: Array) -> Array:
    """Rotate-half RoPE. x: [B, T, H, Dh]; positions: [B, T]."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, -1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, -1)[:, :, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rot * sin).astype(x.dtype)


def cache_mask(lengths: Array, block_mask: Array, capacity: int) -> Array:
    """Which cache rows each new token may attend to.

    Args:
      lengths: [B] committed rows per batch row (the causal prefix).
      block_mask: [B, T, R] bool over the R rows ``lengths[b] + j`` past the
        prefix: ``block_mask[b, i, j]`` lets new token i see row j of that
        block (causal for a sequence, the ancestor mask for a tree; R = T
        unless a drafter expands some nodes of a larger tree).
      capacity: S, the cache rows.
    Returns:
      [B, T, S] bool: the prefix, plus the visible rows of the block.
    """
    t = block_mask.shape[-1]
    rel = jnp.arange(capacity)[None, :] - lengths[:, None]  # [B, S]
    in_block = (rel >= 0) & (rel < t)
    idx = jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None, :], block_mask.shape[:2] + (capacity,))
    from_block = jnp.take_along_axis(block_mask, idx, axis=-1)
    return (rel < 0)[:, None, :] | (in_block[:, None, :] & from_block)


def _write_rows(buf: Array, rows: Array, new: Array) -> Array:
    """Write new [B, T, ...] into buf [B, S, ...] at rows[b, i].

    Callers size S so every write lands in range; an out-of-range row is
    dropped, never clamped onto a live row.
    """
    b = new.shape[0]
    return buf.at[jnp.arange(b)[:, None], rows].set(new.astype(buf.dtype), mode="drop")


def attention(cfg: ModelConfig, lp: LayerParams | FusedLayerParams, x: Array,
              positions: Array, inv_freq: Array, k_buf: Array, v_buf: Array, rows: Array,
              mask: Array, block: tuple[Array, Array] | None = None,
              attention_impl: str = "dense", window: int | None = None
              ) -> tuple[Array, Array, Array]:
    """GQA self-attention of new tokens over the cache; K/V rows written at ``rows``.

    x: [B, T, in] (in = d, or 2d for an EAGLE-3 layer); only the attention
    fields of ``lp`` are read. Returns (out [B, T, d], k_buf, v_buf).
    ``attention_impl`` (static): "dense" is :func:`masked_attention` over ``mask``, or,
    where :func:`specjax.kernels.cpu_attention.use_cpu_attention` says so (float32 on a
    CPU, 1..64 new tokens, no window), the CPU kernel that computes it from ``block``;
    "auto", "xla" or "pallas" route through :func:`specjax.kernels.tree_attention`,
    which reads ``block = (lengths [B], block_mask [B, T, R])``, the arguments ``mask``
    was built from by :func:`cache_mask` ("auto": the Pallas kernel on a GPU, else XLA,
    which computes what "dense" does).
    ``window`` (static): this is a sliding-window layer. "dense" reads it from ``mask``,
    which the caller built with the window (:func:`forward_hidden`); the other
    implementations apply it to ``positions`` themselves.
    """
    b, t, _ = x.shape
    dh = cfg.head_dim
    if isinstance(lp, FusedLayerParams):
        qkv = lp.project("wqkv", x)
        if lp.bqkv is not None:
            qkv = qkv + lp.bqkv
        q, k, v = jnp.split(qkv, [lp.q_dim, lp.q_dim + lp.kv_dim], axis=-1)
    else:
        q = x @ lp.wq
        k = x @ lp.wk
        v = x @ lp.wv
        if lp.bq is not None:
            q, k, v = q + lp.bq, k + lp.bk, v + lp.bv
    q = q.reshape(b, t, cfg.num_heads, dh)
    k = k.reshape(b, t, cfg.num_kv_heads, dh)
    v = v.reshape(b, t, cfg.num_kv_heads, dh)
    if lp.q_norm is not None:
        q = _norm(cfg, q, lp.q_norm)
        k = _norm(cfg, k, lp.k_norm)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    k_buf = _write_rows(k_buf, rows, k)
    v_buf = _write_rows(v_buf, rows, v)
    if attention_impl != "dense":
        lengths, block_mask = block
        # Under a mesh each device attends with its own rows and KV heads (shard_map).
        out = attend_by_heads(partial(tree_attention, impl=attention_impl,
                                      scale=cfg.attn_scale, window=window), q, k_buf, v_buf,
                              lengths, block_mask, positions if window is not None else None)
        return _out_proj(lp, out.reshape(b, t, cfg.num_heads * dh)), k_buf, v_buf

    if block is not None and use_cpu_attention(q, k_buf, window):
        out = cache_attention(q, k_buf, v_buf, *block, cfg.attn_scale, scores=env_scores())
    else:
        out = masked_attention(q, k_buf, v_buf, mask, cfg.attn_scale)
    return _out_proj(lp, out.reshape(b, t, cfg.num_heads * dh)), k_buf, v_buf


def masked_attention(q: Array, k_buf: Array, v_buf: Array, mask: Array, scale: float) -> Array:
    """The dense masked softmax: q [B, T, H, Dh] over k_buf/v_buf [B, S, Hkv, Dh] (GQA:
    query head h reads KV head h // (H / Hkv)) where mask [B, T, S] -> [B, T, H, Dh].
    A query that sees no row averages all S rows (the finite fill keeps it NaN-free)."""
    b, t, h, dh = q.shape
    hkv = k_buf.shape[2]
    q = q.reshape(b, t, hkv, h // hkv, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k_buf, preferred_element_type=jnp.float32)
    scores = scores * scale
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_buf.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v_buf).reshape(b, t, h, dh)


def _out_proj(lp: LayerParams | FusedLayerParams, x: Array, name: str = "wo") -> Array:
    if isinstance(lp, FusedLayerParams):
        return lp.project(name, x)
    return x @ getattr(lp, name)


def decoder_layer(cfg: ModelConfig, lp: LayerParams | FusedLayerParams, x: Array, positions: Array,
                  inv_freq: Array, k_buf: Array, v_buf: Array, rows: Array,
                  mask: Array, block: tuple[Array, Array] | None = None,
                  attention_impl: str = "dense",
                  window: int | None = None) -> tuple[Array, Array, Array]:
    """One pre-norm decoder layer; the target's layers and the drafter's share it.

    x: [B, T, d]; k_buf/v_buf: this layer's [B, S, Hkv, Dh] cache, returned with
    new token i written at row ``rows[b, i]``; mask: [B, T, S] from
    :func:`cache_mask`. ``lp.attn_norm`` may be None: EAGLE-1 drafters feed their
    fc output to the attention without a norm. ``window``: a sliding-window layer
    (:func:`attention`); ``inv_freq`` and ``mask`` must be that layer kind's. Gemma 3's
    ``post_attn_norm`` and ``post_mlp_norm`` (when present) normalise each block's output
    before its residual add.
    """
    h = x if lp.attn_norm is None else _norm(cfg, x, lp.attn_norm)
    attn, k_buf, v_buf = attention(cfg, lp, h, positions, inv_freq, k_buf, v_buf, rows, mask,
                                   block, attention_impl, window)
    if lp.post_attn_norm is not None:
        attn = _norm(cfg, attn, lp.post_attn_norm)
    x = x + attn
    h = _norm(cfg, x, lp.mlp_norm)
    if isinstance(lp, FusedLayerParams):
        gate, up = jnp.split(lp.project("w_gate_up", h), 2, axis=-1)
    else:
        gate, up = h @ lp.w_gate, h @ lp.w_up
    if cfg.hidden_act == "gelu_pytorch_tanh":
        act = jax.nn.gelu(gate, approximate=True)  # GeGLU, tanh-approximated as in PyTorch
    else:
        act = jax.nn.silu(gate)
    mlp = _out_proj(lp, act * up, "w_down")
    if lp.post_mlp_norm is not None:
        mlp = _norm(cfg, mlp, lp.post_mlp_norm)
    return x + mlp, k_buf, v_buf


def forward_hidden(params: Params, cfg: ModelConfig, tokens: Array, positions: Array,
                   cache: KVCache, block_mask: Array | None = None,
                   tap_layers: tuple[int, ...] = (),
                   write_rows: Array | None = None,
                   attention_impl: str = "dense") -> tuple[Array, KVCache, tuple[Array, ...]]:
    """Run the decoder over a block of new tokens.

    Args:
      tokens: [B, T] int token ids.
      positions: [B, T] RoPE positions (prefix length + depth for a tree).
      cache: K/V rows are written at ``cache.lengths[b] + i``; ``lengths`` is
        *not* advanced here, because only the caller knows how many new rows
        are accepted.
      block_mask: [B, T, R] bool visibility of the block rows past the prefix
        (see :func:`cache_mask`); None means causal among the new tokens.
      tap_layers: indices of decoder layers whose *output* hidden states to
        return (EAGLE-3 fuses three of them); layer -1 is the embedding.
      attention_impl: static; "dense" (the inline masked softmax) or a
        :func:`specjax.kernels.tree_attention.tree_attention` implementation.
      write_rows: [B, T] cache rows for the new tokens; default
        ``lengths[b] + i``. A drafter expanding tree nodes writes node j at
        ``lengths[b] + j`` and passes a ``block_mask`` over those tree rows.
        A model with sliding-window layers refuses it: the window needs each block
        row's position, which is the new token's own only with the default rows.
    Returns:
      (hidden [B, T, d] after the final norm, updated cache, taps [B, T, d] each).
    """
    b, t = tokens.shape
    if block_mask is None:
        block_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    mask = cache_mask(cache.lengths, block_mask, cache.capacity)
    local_mask = None
    if any(cfg.is_sliding(i) for i in range(cfg.num_layers)):
        if write_rows is not None or block_mask.shape[-1] != t:
            raise ValueError("a model with sliding-window layers runs its new tokens at the "
                             "default cache rows (write_rows=None, block_mask [B, T, T]): "
                             "the window is a mask on each row's position")
        local_mask = mask & window_visible(cache.lengths, positions, cache.capacity,
                                           cfg.sliding_window)
    if write_rows is None:
        write_rows = cache.lengths[:, None] + jnp.arange(t)[None, :]
    inv_freq = rope_inv_freq(cfg)
    local_inv_freq = rope_inv_freq(cfg, local=True) if local_mask is not None else None
    x = params.embed[tokens]
    if cfg.scale_embeddings:
        # transformers casts sqrt(d) to the weights' dtype before the product.
        x = x * jnp.asarray(math.sqrt(cfg.hidden_size), x.dtype)
    taps = {-1: x} if -1 in tap_layers else {}
    ks, vs = [], []
    for i, lp in enumerate(params.layers):
        local = cfg.is_sliding(i)
        x, k_buf, v_buf = decoder_layer(cfg, lp, x, positions,
                                        local_inv_freq if local else inv_freq,
                                        cache.k[i], cache.v[i], write_rows,
                                        local_mask if local else mask,
                                        (cache.lengths, block_mask), attention_impl,
                                        cfg.sliding_window if local else None)
        ks.append(k_buf)
        vs.append(v_buf)
        if i in tap_layers:
            taps[i] = x
    hidden = _norm(cfg, x, params.final_norm)
    cache = KVCache(k=tuple(ks), v=tuple(vs), lengths=cache.lengths)
    return hidden, cache, tuple(taps[i] for i in tap_layers)


def lm_head(params: Params, hidden: Array) -> Array:
    """Full-vocabulary logits in fp32. hidden: [B, ..., d] -> [B, ..., V].

    Under a mesh the logits stay split over the vocabulary like the head's rows
    (:func:`specjax.sharding.constrain_logits`); without one this is the plain product,
    taken by the CPU rowdot kernel for 1..16 rows (a decode step, or a verify step's tree; see
    :func:`specjax.kernels.cpu_rowdot.head_product`).
    """
    return constrain_logits(head_product(hidden, params.head))


@partial(jax.jit, static_argnames=("cfg",))
def forward(params: Params, cfg: ModelConfig, tokens: Array, positions: Array, cache: KVCache,
            block_mask: Array | None = None) -> tuple[Array, KVCache]:
    """Logits [B, T, V] (fp32) for every new token, and the written cache."""
    hidden, cache, _ = forward_hidden(params, cfg, tokens, positions, cache, block_mask)
    return lm_head(params, hidden), cache
