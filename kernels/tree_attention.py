"""Tree attention: the T query rows of a draft tree over a KV cache with a ragged prefix.

This is the attention of a verification pass (or of a drafter expanding tree nodes): every
batch row has committed ``prefix_len[b]`` cache rows, and the tree's own K/V were written
just past them, tree row ``j`` at cache row ``prefix_len[b] + j``.

Shapes, for every implementation:

* ``q``: ``[B, T, Hq, Dh]`` the tree's queries (float32, bfloat16 or float16);
* ``k_cache``, ``v_cache``: ``[B, S, Hkv, Dh]``, ``Hq = Hkv * group`` (GQA: query head
  ``h`` reads KV head ``h // group``, the layout of :func:`specjax.model.attention`);
* ``prefix_len``: ``[B]`` integer, the committed rows of each batch row (ragged);
* ``tree_mask``: the ancestor-or-self mask over the ``R`` tree rows, either bool
  ``[B, T, R]`` or packed as ``[B, T, W]`` uint32 words by
  :func:`specjax.tree.pack_ancestors` (bit ``j % 32`` of word ``j // 32`` is tree row
  ``j``; ``R = tree_len``, default ``T``, and ``R <= 32 * W``). ``R == T`` for a
  verification pass; a drafter that expands K frontier nodes of an N-node workspace has
  ``T = K`` queries over ``R = N`` tree rows;
* result: ``[B, T, Hq, Dh]`` in ``q``'s dtype.

The visibility invariant. Query ``i`` of batch row ``b`` sees exactly

* every prefix row ``s < prefix_len[b]``, and
* tree row ``prefix_len[b] + j`` for each ``j < R`` with ``tree_mask[b, i, j]``,

and nothing else: no row past the tree, no row past ``S``, no padding. This is the mask
:func:`specjax.model.cache_mask` builds from ``(prefix_len, tree_mask)``, so the output
equals :func:`specjax.model.attention`'s masked softmax over the same cache. A query that
sees no row at all (never the case for a valid tree: a node sees itself) gets 0, where the
model's dense path would average every cache row.

Implementations: :func:`tree_attention_ref` (plain jnp in float32, the specification),
:func:`tree_attention_xla` (the default off GPU: the model's dense masked softmax, inputs
in their own dtype, float32 accumulation) and :func:`tree_attention_pallas` (a
flash-attention Pallas kernel, Triton lowering, that skips the key blocks nobody in a
query block can see). :func:`tree_attention` validates and dispatches.
:func:`count_tree_blocks` counts the (query block x tree key block) tiles the kernel
computes for a mask, the figure a DFS node order is meant to lower.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.experimental import pallas as pl

from specjax.compat import pallas_gpu_available, pltriton, triton_params
from specjax.tree.base import pack_ancestors, unpack_ancestors

Impl = Literal["auto", "xla", "pallas", "ref"]

# Finite, so that the running max of a row that has seen no key yet stays finite and
# exp(m_old - m_new) is never exp(-inf - -inf) = NaN (the choice of jax's GPU flash kernel).
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

# Input dtypes every implementation accepts; the kernel accumulates in float32 for all.
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# Triton's tl.dot needs every tile dimension >= 16.
_MIN_BLOCK = 16


# --------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------


def _is_packed(tree_mask: Array) -> bool:
    return tree_mask.dtype == jnp.uint32


def _tree_rows(tree_mask: Array, tree_len: int | None) -> int:
    """R, the tree rows the mask covers: its last axis when bool, ``tree_len`` or T when
    packed (the words alone give R only to a multiple of 32)."""
    if not _is_packed(tree_mask):
        return tree_mask.shape[-1]
    return tree_mask.shape[-2] if tree_len is None else tree_len


def _bool_mask(tree_mask: Array, tree_len: int | None) -> Array:
    """The [..., T, R] bool mask of a bool or packed ``tree_mask``."""
    if _is_packed(tree_mask):
        return unpack_ancestors(tree_mask, _tree_rows(tree_mask, tree_len))
    return tree_mask.astype(bool)


def _block_occupancy(mask: Array, block_q: int, block_k: int) -> Array:
    """[..., cdiv(T, block_q), cdiv(R, block_k)] bool: does any query of the query block see
    any row of the tree key block? mask: [..., T, R] bool, padded with False."""
    t, r = mask.shape[-2:]
    nq, nk = pl.cdiv(t, block_q), pl.cdiv(r, block_k)
    pad = [(0, 0)] * (mask.ndim - 2) + [(0, nq * block_q - t), (0, nk * block_k - r)]
    tiles = jnp.pad(mask, pad).reshape(mask.shape[:-2] + (nq, block_q, nk, block_k))
    return jnp.any(tiles, axis=(-3, -1))


def count_tree_blocks(tree_mask: Array, block_size: int, *, block_k: int | None = None,
                      tree_len: int | None = None) -> Array:
    """Non-empty (query block x tree key block) tiles of a tree mask, per batch row.

    tree_mask: [B, T, R] bool, [T, R] bool (one tree) or [B, T, W] / [T, W] packed uint32;
    block_size: the query block (and the tree key block unless ``block_k`` is given).
    Returns int32 ``[B]`` (``[]`` for one tree): the tiles :func:`tree_attention_pallas`
    computes in the tree part for these blocks; ``cdiv(T, block_size) * cdiv(R, block_k)``
    is the dense count. A node order in which subtrees are contiguous (DFS) keeps a query
    block's ancestors in few key blocks, so it lowers this count; issue 13 reports it for
    block sizes 32 and 16 before and after reordering.
    """
    block_k = block_size if block_k is None else block_k
    _check_block("block_size", block_size, minimum=1)
    _check_block("block_k", block_k, minimum=1)
    occ = _block_occupancy(_bool_mask(tree_mask, tree_len), block_size, block_k)
    return jnp.sum(occ, axis=(-2, -1), dtype=jnp.int32)


def _visible(prefix_len: Array, mask: Array, capacity: int) -> Array:
    """[B, T, S] bool visibility over the cache rows: prefix, plus the tree rows ``mask``
    [B, T, R] allows (the construction of :func:`specjax.model.cache_mask`)."""
    r = mask.shape[-1]
    rel = jnp.arange(capacity)[None, :] - prefix_len[:, None]  # [B, S]: tree row index
    in_tree = (rel >= 0) & (rel < r)
    idx = jnp.broadcast_to(jnp.clip(rel, 0, r - 1)[:, None, :], mask.shape[:2] + (capacity,))
    from_tree = jnp.take_along_axis(mask, idx, axis=-1)
    return (rel < 0)[:, None, :] | (in_tree[:, None, :] & from_tree)


def window_visible(prefix_len: Array, positions: Array, capacity: int, window: int) -> Array:
    """[B, T, S] bool: the cache rows inside a sliding window of ``window`` positions.

    Query i (at ``positions[b, i]``) may see a key at position k iff
    ``positions[b, i] - k < window`` (transformers' ``sliding_window_overlay``). Every
    cache row's position follows from the layout: a prefix row ``s < prefix_len[b]`` holds
    position ``s`` (the committed sequence, compacted after every step), and block row
    ``prefix_len[b] + j`` holds the new token j, at ``positions[b, j]`` (so R == T: a block
    whose rows are not its own queries, a drafter's workspace, has no positions here).
    Rows past the block get a position no query is near; :func:`_visible` drops them anyway.
    AND this with the causal/tree visibility; alone it is not a mask.
    """
    t = positions.shape[1]
    rel = jnp.arange(capacity)[None, :] - prefix_len[:, None]  # [B, S]
    block_pos = jnp.take_along_axis(positions, jnp.clip(rel, 0, t - 1), axis=1)  # [B, S]
    key_pos = jnp.where(rel < 0, jnp.arange(capacity)[None, :], block_pos)
    return positions[:, :, None] - key_pos[:, None, :] < window


# --------------------------------------------------------------------------------------
# Reference and XLA
# --------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("tree_len", "scale", "window"))
def tree_attention_ref(q: Array, k_cache: Array, v_cache: Array, prefix_len: Array,
                       tree_mask: Array, *, tree_len: int | None = None,
                       scale: float | None = None, window: int | None = None,
                       positions: Array | None = None) -> Array:
    """Plain-jnp specification, in float32 at full precision.

    q: [B, T, Hq, Dh]; k_cache, v_cache: [B, S, Hkv, Dh]; prefix_len: [B] int;
    tree_mask: [B, T, R] bool or [B, T, W] packed uint32 (``tree_len`` = R, default T)
    -> [B, T, Hq, Dh] in q's dtype.

    Scores ``q . k * scale`` (default ``1 / sqrt(Dh)``) over every cache row, the rows
    outside the visibility invariant (module docstring) removed, and with ``window`` also
    those outside the sliding window (:func:`window_visible`, from ``positions`` [B, T]),
    softmax, weighted sum of V. A query with no visible row gives 0.
    """
    b, t, hq, dh = q.shape
    s, hkv = k_cache.shape[1:3]
    vis = _all_visible(prefix_len, tree_mask, tree_len, s, window, positions)[:, None, None]
    qf = q.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", qf, k_cache.astype(jnp.float32),
                        precision=lax.Precision.HIGHEST) * _scale(scale, dh)
    scores = jnp.where(vis, scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.where(vis, jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    probs = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_cache.astype(jnp.float32),
                     precision=lax.Precision.HIGHEST)
    return out.reshape(b, t, hq, dh).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("tree_len", "scale", "window"))
def tree_attention_xla(q: Array, k_cache: Array, v_cache: Array, prefix_len: Array,
                       tree_mask: Array, *, tree_len: int | None = None,
                       scale: float | None = None, window: int | None = None,
                       positions: Array | None = None) -> Array:
    """XLA path: :func:`specjax.model.attention`'s dense masked softmax. Shapes as the
    reference.

    The products read q, K and V in their own dtype with float32 accumulation (a bfloat16
    cache is never copied to float32), the softmax is float32 and its probabilities are
    cast to V's dtype, as the model does, so swapping this in for the model's inline
    attention changes no result but that of a query with no visible row (0 here). Every
    cache row is scored: XLA cannot skip the rows past a ragged prefix.
    """
    b, t, hq, dh = q.shape
    s, hkv = k_cache.shape[1:3]
    vis = _all_visible(prefix_len, tree_mask, tree_len, s, window, positions)
    qg = q.reshape(b, t, hkv, hq // hkv, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k_cache, preferred_element_type=jnp.float32)
    scores = scores * _scale(scale, dh)
    scores = jnp.where(vis[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_cache, preferred_element_type=jnp.float32)
    seen = jnp.any(vis, axis=-1)[:, :, None, None, None]  # [B, T, 1, 1, 1]
    return jnp.where(seen, out, 0.0).reshape(b, t, hq, dh).astype(q.dtype)


# --------------------------------------------------------------------------------------
# Pallas
# --------------------------------------------------------------------------------------


def _tree_attention_kernel(q_ref, k_ref, v_ref, plen_ref, words_ref, kblk_ref, nblk_ref,
                           o_ref, *, block_k: int, block_t: int, tree_len: int,
                           scale: float) -> None:
    """One program: query block ``program_id(0)`` of head ``program_id(1)``, batch row
    ``program_id(2)``.

    Refs: q_ref, o_ref [block_q, Dh]; k_ref, v_ref [S, Dh] (this row's KV head, whole);
    plen_ref [] the prefix length; words_ref [block_q, W] the block's packed mask rows;
    kblk_ref [nT] the indices of the tree key blocks some query of the block sees,
    ascending, and nblk_ref [] how many there are.

    Flash attention (online softmax, float32 running max ``m``, sum ``l_sum`` and unscaled
    output ``o``) in two loops: the prefix, every row visible, ``cdiv(prefix_len,
    block_k)`` blocks (blocks past the prefix are never visited); then only the listed
    tree key blocks, each row masked by the ancestor bits. Every K/V load is masked, so
    rows past the prefix, the tree or the cache cost no memory traffic.
    """
    block_q, dh = q_ref.shape
    capacity = k_ref.shape[0]
    plen = plen_ref[()]
    cols = jnp.arange(dh)[None, :]
    q = q_ref[...]

    def load_kv(rows: Array, row_ok: Array) -> tuple[Array, Array]:
        # Masked-off rows are also clamped to 0 so that no index is out of bounds (the
        # interpreter gathers them; on the GPU the mask alone keeps them unread).
        idx = jnp.where(row_ok, rows, 0)[:, None]
        k = pltriton.load(k_ref.at[idx, cols], mask=row_ok[:, None], other=0.0)
        v = pltriton.load(v_ref.at[idx, cols], mask=row_ok[:, None], other=0.0)
        return k, v

    def update(carry, k: Array, v: Array, visible: Array):
        o, m, l_sum = carry
        # HIGHEST: float32 products in IEEE, not TF32; no effect on 16-bit inputs.
        s = pltriton.dot(q, k, trans_b=True, precision=lax.Precision.HIGHEST) * scale
        s = jnp.where(visible, s, _MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        # Zeroed explicitly: in a row that has seen nothing yet, s - m_new is 0, not -inf.
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
        l_sum = alpha * l_sum + jnp.sum(p, axis=1)
        pv = pltriton.dot(p.astype(v.dtype), v, precision=lax.Precision.HIGHEST)
        return alpha[:, None] * o + pv, m_new, l_sum

    def prefix_block(kb, carry):
        rows = kb * block_k + jnp.arange(block_k)
        row_ok = rows < prefix_end
        k, v = load_kv(rows, row_ok)
        return update(carry, k, v, row_ok[None, :])

    def tree_block(n, carry):
        j = kblk_ref[n] * block_t + jnp.arange(block_t)  # tree rows of this key block
        rows = plen + j
        row_ok = (j < tree_len) & (rows < capacity)
        word = jnp.where(row_ok, j // 32, 0)[None, :]
        words = words_ref[jnp.arange(block_q)[:, None], word]  # [block_q, block_t]
        bits = (words >> (j % 32).astype(jnp.uint32)[None, :]) & 1
        k, v = load_kv(rows, row_ok)
        return update(carry, k, v, (bits != 0) & row_ok[None, :])

    carry = (jnp.zeros((block_q, dh), jnp.float32),
             jnp.full((block_q,), _MASK_VALUE, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    prefix_end = jnp.minimum(plen, capacity)
    carry = lax.fori_loop(0, pl.cdiv(prefix_end, block_k), prefix_block, carry)
    o, _, l_sum = lax.fori_loop(0, nblk_ref[()], tree_block, carry)
    # l_sum == 0 only for a query that saw nothing (a padding row): its o is 0 too.
    o_ref[...] = (o / jnp.where(l_sum > 0, l_sum, 1.0)[:, None]).astype(o_ref.dtype)


def _scale(scale: float | None, dh: int) -> float:
    return 1.0 / math.sqrt(dh) if scale is None else scale


def _all_visible(prefix_len: Array, tree_mask: Array, tree_len: int | None, capacity: int,
                 window: int | None, positions: Array | None) -> Array:
    """[B, T, S] the visibility invariant, ANDed with the sliding window when one is set."""
    vis = _visible(prefix_len, _bool_mask(tree_mask, tree_len), capacity)
    if window is not None:
        vis &= window_visible(prefix_len, positions, capacity, window)
    return vis


def _check_block(name: str, value: int, minimum: int = _MIN_BLOCK) -> None:
    if value < minimum or value & (value - 1):
        why = (" (the Triton lowering needs power-of-two tiles, tl.dot at least 16)"
               if minimum == _MIN_BLOCK else "")
        raise ValueError(f"{name} must be a power of two >= {minimum}{why}, got {value}")


def _clamp_block(block: int, n: int) -> int:
    """The block, shrunk to the next power of two above n (no wasted lanes), at least 16."""
    return max(_MIN_BLOCK, min(block, pl.next_power_of_2(n)))


@functools.partial(jax.jit, static_argnames=("tree_len", "block_q", "block_k", "block_t",
                                             "num_warps", "num_stages", "interpret", "scale"))
def tree_attention_pallas(q: Array, k_cache: Array, v_cache: Array, prefix_len: Array,
                          tree_mask: Array, *, tree_len: int | None = None, block_q: int = 32,
                          block_k: int = 64, block_t: int = 32, num_warps: int = 4,
                          num_stages: int = 2, interpret: bool = False,
                          scale: float | None = None) -> Array:
    """Pallas kernel (Triton lowering). Shapes as the reference; Dh a power of two >= 16,
    q, k_cache and v_cache of one dtype, prefix_len int32.

    Grid (cdiv(T, block_q), Hq, B); query blocks of one head, then the heads of one KV
    group, are neighbours, so they meet their K/V rows in L2. T is padded to a whole
    number of query blocks here (padding rows see nothing and are sliced off). Before the
    call, plain jnp lists for each (batch row, query block) the tree key blocks that hold
    a visible row, so the kernel loops over those alone (see :func:`count_tree_blocks`).
    The blocks are clamped to the next power of two above T, R and S, and to >= 16.

    Args:
      tree_len: R for a packed mask (default T); ignored for a bool mask.
      block_q: query rows per program, a power of two >= 16.
      block_k: prefix rows per step, a power of two >= 16.
      block_t: tree rows per tree key block, a power of two >= 16.
      num_warps, num_stages: Triton launch parameters.
      interpret: run the kernel body in the Pallas interpreter (any backend, e.g. CPU).
      scale: the factor on q . k (default 1 / sqrt(Dh)).
    """
    for name, value in (("block_q", block_q), ("block_k", block_k), ("block_t", block_t)):
        _check_block(name, value)
    b, t, hq, dh = q.shape
    s, hkv = k_cache.shape[1:3]
    group = hq // hkv
    mask = _bool_mask(tree_mask, tree_len)  # [B, T, R]
    r = mask.shape[-1]
    words = tree_mask if _is_packed(tree_mask) else pack_ancestors(mask)
    block_q, block_t = _clamp_block(block_q, t), _clamp_block(block_t, r)
    block_k = _clamp_block(block_k, s)
    nq = pl.cdiv(t, block_q)
    t_pad = nq * block_q

    occ = _block_occupancy(mask, block_q, block_t)  # [B, nq, nT]
    # A stable sort on "empty" puts the non-empty key blocks first, in ascending order.
    kblocks = jnp.argsort(~occ, axis=-1, stable=True).astype(jnp.int32)
    nblocks = jnp.sum(occ, axis=-1, dtype=jnp.int32)  # [B, nq]
    q = jnp.pad(q, ((0, 0), (0, t_pad - t), (0, 0), (0, 0)))
    words = jnp.pad(words, ((0, 0), (0, t_pad - t), (0, 0)))  # padding rows: no tree bits

    kernel = functools.partial(_tree_attention_kernel, block_k=block_k, block_t=block_t,
                               tree_len=r, scale=_scale(scale, dh))
    kv_spec = pl.BlockSpec((None, s, None, dh), lambda i, h, bi: (bi, 0, lax.div(h, group), 0))
    out = pl.pallas_call(
        kernel,
        grid=(nq, hq, b),
        in_specs=[
            pl.BlockSpec((None, block_q, None, dh), lambda i, h, bi: (bi, i, h, 0)),
            kv_spec,
            kv_spec,
            pl.BlockSpec((None,), lambda i, h, bi: (bi,)),
            pl.BlockSpec((None, block_q, words.shape[-1]), lambda i, h, bi: (bi, i, 0)),
            pl.BlockSpec((None, None, occ.shape[-1]), lambda i, h, bi: (bi, i, 0)),
            pl.BlockSpec((None, None), lambda i, h, bi: (bi, i)),
        ],
        out_specs=pl.BlockSpec((None, block_q, None, dh), lambda i, h, bi: (bi, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"tree_attention_{block_q=}_{block_k=}_{block_t=}",
    )(q, k_cache, v_cache, prefix_len, words, kblocks, nblocks)
    return out[:, :t]


# --------------------------------------------------------------------------------------
# Dispatcher
# --------------------------------------------------------------------------------------


def _pallas_supports(q: Array, k_cache: Array, v_cache: Array) -> bool:
    dh = q.shape[-1]
    return dh >= _MIN_BLOCK and not dh & (dh - 1) and q.dtype == k_cache.dtype == v_cache.dtype


def _validate(q: Array, k_cache: Array, v_cache: Array, prefix_len: Array, tree_mask: Array,
              tree_len: int | None) -> None:
    if q.ndim != 4 or k_cache.ndim != 4:
        raise ValueError(f"expected q [B, T, Hq, Dh] and k_cache, v_cache [B, S, Hkv, Dh]; got "
                         f"q {q.shape}, k_cache {k_cache.shape}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ in shape")
    b, t, hq, dh = q.shape
    bk, s, hkv, dk = k_cache.shape
    if bk != b:
        raise ValueError(f"batch mismatch: q has B={b}, the cache has B={bk}")
    if dk != dh:
        raise ValueError(f"head_dim mismatch: q has Dh={dh}, the cache has Dh={dk}")
    if hq % hkv:
        raise ValueError(f"query heads Hq={hq} must be a multiple of the KV heads Hkv={hkv} "
                         "(GQA)")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dtype not in _DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if prefix_len.shape != (b,) or not jnp.issubdtype(prefix_len.dtype, jnp.integer):
        raise ValueError(f"prefix_len must be an integer array of shape ({b},), got "
                         f"{prefix_len.dtype} {prefix_len.shape}")
    if tree_mask.ndim != 3 or tree_mask.shape[:2] != (b, t):
        raise ValueError(f"tree_mask must be [B, T, R] bool or [B, T, W] packed uint32 with "
                         f"B={b}, T={t}; got {tree_mask.shape}")
    if _is_packed(tree_mask):
        r = _tree_rows(tree_mask, tree_len)
        capacity = 32 * tree_mask.shape[-1]
        if not 1 <= r <= capacity:
            raise ValueError(f"the packed mask has {tree_mask.shape[-1]} uint32 word(s) per "
                             f"row, room for {capacity} tree rows, but the tree has R={r} "
                             "(tree_len, default T)")
    elif tree_mask.dtype != jnp.bool_:
        raise ValueError(f"tree_mask must be bool or packed uint32, got {tree_mask.dtype}")
    r = _tree_rows(tree_mask, tree_len)
    if r > s:
        raise ValueError(f"the tree has R={r} rows but the cache only S={s}")


def tree_attention(q: Array, k_cache: Array, v_cache: Array, prefix_len: Array,
                   tree_mask: Array, *, tree_len: int | None = None,
                   impl: Impl = "auto", scale: float | None = None, window: int | None = None,
                   positions: Array | None = None) -> Array:
    """Attention of a draft tree's queries over a KV cache with a ragged prefix.

    q: [B, T, Hq, Dh]; k_cache, v_cache: [B, S, Hkv, Dh] with the tree's K/V written at
    rows ``prefix_len[b] + j``; prefix_len: [B] int; tree_mask: [B, T, R] bool or
    [B, T, W] packed uint32 (``tree_len`` = R, default T) -> [B, T, Hq, Dh] in q's dtype.
    Query i sees the prefix and the tree rows its mask row allows (module docstring).

    ``impl``: "auto" (the Pallas kernel when the default backend is a GPU and the kernel
    supports the inputs, i.e. Dh a power of two >= 16, one dtype for q, K and V and no
    sliding window; else XLA), "xla", "pallas" or "ref".

    ``scale``: the factor on q . k (default 1 / sqrt(Dh); Gemma's ``query_pre_attn_scalar``
    sets another). ``window`` with ``positions`` [B, T] (the queries' RoPE positions; R must
    be T): a sliding-window layer, where query i also needs ``positions[b, i] - k < window``
    for the key at position k (:func:`window_visible`). The Pallas kernel does not
    implement the window and refuses it.

    Raises:
      ValueError: on inconsistent shapes or dtypes, Hq not a multiple of Hkv, a packed mask
        too narrow for R tree rows, more tree rows than cache rows, or an unknown impl.
    """
    _validate(q, k_cache, v_cache, prefix_len, tree_mask, tree_len)
    if window is not None:
        t = q.shape[1]
        if positions is None or positions.shape != (q.shape[0], t):
            raise ValueError(f"a sliding window needs the queries' positions [B, T] = "
                             f"[{q.shape[0]}, {t}], got "
                             f"{None if positions is None else positions.shape}")
        if _tree_rows(tree_mask, tree_len) != t:
            raise ValueError("a sliding window needs the block rows to be the queries' own "
                             f"(R == T); got R={_tree_rows(tree_mask, tree_len)}, T={t}")
    prefix_len = prefix_len.astype(jnp.int32)
    if impl == "auto":
        on_gpu = pallas_gpu_available()
        impl = ("pallas" if on_gpu and window is None and _pallas_supports(q, k_cache, v_cache)
                else "xla")
    if impl == "pallas" and window is not None:
        raise ValueError("the Pallas tree-attention kernel does not implement sliding-window "
                         "layers (Gemma 3's local layers); use attention 'auto', 'xla' or "
                         "'dense'")
    if impl == "pallas":
        if not _pallas_supports(q, k_cache, v_cache):
            raise ValueError(f"the Pallas kernel needs Dh a power of two >= 16 and one dtype "
                             f"for q, k_cache and v_cache; got Dh={q.shape[-1]}, "
                             f"{q.dtype}/{k_cache.dtype}/{v_cache.dtype}")
        return tree_attention_pallas(q, k_cache, v_cache, prefix_len, tree_mask,
                                     tree_len=tree_len, scale=scale)
    extra = dict(tree_len=tree_len, scale=scale, window=window, positions=positions)
    if impl == "xla":
        return tree_attention_xla(q, k_cache, v_cache, prefix_len, tree_mask, **extra)
    if impl == "ref":
        return tree_attention_ref(q, k_cache, v_cache, prefix_len, tree_mask, **extra)
    raise ValueError(f"unknown impl {impl!r}: expected 'auto', 'xla', 'pallas' or 'ref'")
