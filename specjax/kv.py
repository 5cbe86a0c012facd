"""Compacting the KV cache after a tree verification.

The tree forward writes node i of batch row b at cache row ``lengths[b] + i``. Once a path
is accepted, its rows (root first) must sit contiguously at ``lengths[b] + 0..num_accepted``
so the cache again holds one linear sequence.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import Array

from specjax.model import KVCache


def _compact_rows(buf: Array, lengths: Array, path: Array, num_accepted: Array,
                  tree_size: int) -> Array:
    """Move the accepted tree rows of one layer's buffer into place.

    Args:
      buf: [B, S, Hkv, Dh] with the tree at rows ``lengths[b] + 0..T-1``.
      lengths: [B] int32 committed rows before the tree.
      path: [B, P] int32 node indices (root first), NO_NODE (-1) after the path.
      num_accepted: [B] int32; path slots 0..num_accepted are live.
      tree_size: T.
    Returns:
      buf with rows ``lengths[b] + j`` = tree row ``path[b, j]`` for j <= num_accepted[b].
    """
    b, s = buf.shape[:2]
    rows = jnp.arange(b)[:, None]
    tree_rows = jnp.clip(lengths[:, None] + jnp.arange(tree_size)[None, :], 0, s - 1)
    # Gather into a scratch copy first: the path only ever moves rows towards lower
    # indices, so the read and write ranges overlap, and an in-place shifted update of the
    # same buffer has been miscompiled by XLA on CPU. Reading through a separate array
    # makes the result independent of the order in which rows are written.
    scratch = buf[rows, tree_rows]  # [B, T, Hkv, Dh]
    moved = jnp.take_along_axis(scratch, jnp.clip(path, 0, tree_size - 1)[:, :, None, None],
                                axis=1)  # [B, P, Hkv, Dh]
    slot = jnp.arange(path.shape[1])[None, :]
    # Slots past the path write to row S (out of range), which mode="drop" discards.
    dest = jnp.where(slot <= num_accepted[:, None], lengths[:, None] + slot, s)
    return buf.at[rows, dest].set(moved, mode="drop")


def compact_cache(cache: KVCache, path: Array, num_accepted: Array, tree_size: int) -> KVCache:
    """Keep the accepted path of a verified tree and commit it.

    Args:
      cache: after the tree forward; node i of row b at rows ``lengths[b] + i``.
      path: [B, D+1] int32 accepted node indices, root (0) first, -1 after the path
        (``Acceptance.path``).
      num_accepted: [B] int32 accepted draft nodes.
      tree_size: T, static.
    Returns:
      The cache with the root and accepted drafts at rows ``lengths[b] + 0..num_accepted``
      and ``lengths += num_accepted + 1``. The bonus token is not in the cache: it is the
      next step's root. Rows past the new length keep stale tree rows, which nothing
      attends to (``model.cache_mask``) and the next write overwrites.
    """
    def one(buf: Array) -> Array:
        return _compact_rows(buf, cache.lengths, path, num_accepted, tree_size)

    return dataclasses.replace(cache, k=tuple(one(k) for k in cache.k),
                               v=tuple(one(v) for v in cache.v),
                               lengths=cache.lengths + num_accepted.astype(jnp.int32) + 1)
