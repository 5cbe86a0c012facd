"""Node orders of a draft tree: breadth first (the canonical layout) and depth first.

Verification only needs parents before children and siblings in drafted order; both
orders keep that. Breadth first is the layout the builders emit (EAGLE's
``sorted(paths, key=(len, path))``); depth first (pre-order) is DySpec's appendix-C
reordering, an approximation of heavy-path decomposition: a subtree's nodes become one
contiguous range, so the ancestor mask's non-zero entries cluster near the diagonal and
fewer (query block x key block) tiles of a tree-attention kernel hold a visible key.

Every function is batched over rows and jit-friendly; orders are given as ``new_index``
[B, T] int32 (the position each node moves to), valid nodes first, padding after in index
order, the root staying at 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from specjax.tree.base import DraftTree


def sibling_rank(tree: DraftTree) -> Array:
    """[B, T] int32: how many valid siblings come before each node (0 for the root)."""
    t = tree.num_nodes
    same = tree.parent[:, :, None] == tree.parent[:, None, :]  # [B, i, j]
    before = jnp.arange(t)[None, :] < jnp.arange(t)[:, None]  # j < i
    return jnp.sum(same & before & tree.valid[:, None, :], axis=-1).astype(jnp.int32)


def _padding_last(new_index: Array, valid: Array) -> Array:
    """Place invalid nodes after the valid ones, in index order."""
    n_valid = jnp.sum(valid, axis=1, keepdims=True)
    pad_pos = n_valid + jnp.cumsum(~valid, axis=1) - 1
    return jnp.where(valid, new_index, pad_pos).astype(jnp.int32)


def bfs_order(tree: DraftTree) -> Array:
    """Breadth-first positions: by depth, then the parent's position, then sibling rank."""
    b, t = tree.tokens.shape
    rank = sibling_rank(tree)

    def level(d, carry):
        new, pos = carry
        at = tree.valid & (tree.depth == d)
        parent_pos = jnp.take_along_axis(new, jnp.clip(tree.parent, 0), axis=1)
        key = jnp.where(at, parent_pos * t + rank, t * t + t)
        place = jnp.argsort(jnp.argsort(key, axis=1, stable=True), axis=1)
        new = jnp.where(at, pos[:, None] + place, new)
        return new, pos + jnp.sum(at, axis=1)

    new, _ = jax.lax.fori_loop(1, t, level, (jnp.zeros((b, t), jnp.int32),
                                             jnp.ones((b,), jnp.int32)))
    return _padding_last(new, tree.valid)


def dfs_order(tree: DraftTree) -> Array:
    """Depth-first pre-order positions, children in sibling-rank order.

    A node's position is its depth plus, over each ancestor-or-self ``a``, the sizes of the
    subtrees of ``a``'s earlier siblings: closed form, no sequential walk.
    """
    valid = tree.valid
    anc = tree.ancestors & valid[:, :, None] & valid[:, None, :]
    size = jnp.sum(anc, axis=1)  # [B, T] nodes in each subtree, itself included
    rank = sibling_rank(tree)
    earlier = ((tree.parent[:, :, None] == tree.parent[:, None, :])
               & (rank[:, None, :] < rank[:, :, None]) & valid[:, None, :])  # [B, a, s]
    earlier = earlier.at[:, :, 0].set(False)
    offset = jnp.sum(earlier * size[:, None, :], axis=-1)  # [B, T]
    pre = tree.depth + jnp.sum(anc * offset[:, None, :], axis=-1)
    return _padding_last(pre, valid)


def permute_nodes(tree: DraftTree, new_index: Array) -> DraftTree:
    """The same tree with node i moved to ``new_index[b, i]`` (a permutation per row that
    keeps the root at 0 and parents before children)."""
    perm = jnp.argsort(new_index, axis=1)  # [B, T] old index at each new position

    def take(x: Array) -> Array:
        return jnp.take_along_axis(x, perm.reshape(perm.shape + (1,) * (x.ndim - 2)), axis=1)

    parent = take(tree.parent)
    parent = jnp.where(parent >= 0,
                       jnp.take_along_axis(new_index, jnp.clip(parent, 0), axis=1), -1)
    anc = take(tree.ancestors)  # rows
    anc = jnp.take_along_axis(anc, perm[:, None, :], axis=2)  # columns
    return DraftTree(tokens=take(tree.tokens), parent=parent.astype(jnp.int32),
                     depth=take(tree.depth), valid=take(tree.valid), ancestors=anc,
                     draft_logp=take(tree.draft_logp), score=take(tree.score),
                     draft_dist=None if tree.draft_dist is None else take(tree.draft_dist),
                     sampled=tree.sampled, fixed=None if tree.fixed is None else take(tree.fixed))


def mask_blocks(ancestors: Array, block: int) -> Array:
    """[B] int32 non-empty (query block x key block) tiles of a [B, T, T] ancestor mask: the
    tiles a tree-attention kernel visits (see :func:`specjax.kernels.tree_attention.
    count_tree_blocks`, which this calls)."""
    from specjax.kernels.tree_attention import count_tree_blocks  # the kernel imports trees

    return count_tree_blocks(ancestors, block)
