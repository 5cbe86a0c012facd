"""Static trees: a fixed shape given as child-rank paths (Medusa / EAGLE-1 path lists)."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from specjax.tree.base import (
    Carry,
    DraftTree,
    ExpandFn,
    Paths,
    candidate_vocab,
    dense_dist,
    draft_children,
    draft_mode,
    finish_tree,
    padding_rows,
)
from specjax.tree.spec import TreeSpec, register


def normalize_paths(paths: Sequence[Sequence[int]]) -> Paths:
    """Validate a static tree's path list and return it in node order.

    A path is a tuple of child ranks from the root: ``(0,)`` is the root's first candidate,
    ``(0, 1)`` that node's second candidate. The list must be non-empty, without duplicates,
    prefix-closed (every path's parent path is listed) and have contiguous ranks (a node
    with ``n`` children lists ranks ``0..n-1``). Node ``i + 1`` of the tree is the
    returned ``paths[i]``: sorted by (length, path), i.e. breadth first, as EAGLE does.

    Raises:
      ValueError: describing the first violation found.
    """
    try:
        norm = [tuple(operator.index(r) for r in p) for p in paths]
    except TypeError as e:
        raise ValueError(f"paths must be a sequence of sequences of ints: {e}") from None
    if not norm:
        raise ValueError("paths must list at least one node")
    seen: set[tuple[int, ...]] = set()
    for p in norm:
        if not p:
            raise ValueError("the empty path () is the root and must not be listed")
        if min(p) < 0:
            raise ValueError(f"path {p} has a negative rank")
        if p in seen:
            raise ValueError(f"path {p} is listed twice")
        seen.add(p)
    children: dict[tuple[int, ...], list[int]] = {}
    for p in norm:
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"paths are not prefix-closed: {p} is listed but its parent "
                             f"{p[:-1]} is not")
        children.setdefault(p[:-1], []).append(p[-1])
    for par, ranks in children.items():
        if sorted(ranks) != list(range(len(ranks))):
            raise ValueError(f"the children of {par or 'the root'} have ranks {sorted(ranks)}; "
                             f"ranks must be contiguous from 0")
    return tuple(sorted(norm, key=lambda p: (len(p), p)))


def build_static(expand: ExpandFn, carry: Carry, root: Array,
                 paths: Sequence[Sequence[int]], *, key: Array | None = None,
                 temperature: float | Array = 0.0,
                 vocab_size: int | None = None) -> tuple[DraftTree, Carry]:
    """A static tree given as a path list of child ranks (Medusa / EAGLE-1 style).

    ``paths`` (static) e.g. ``((0,), (1,), (0, 0), (0, 1), (1, 0))``: the root's first and
    second candidates, the first candidate's first two, the second candidate's first. Node
    ``i + 1`` is ``normalize_paths(paths)[i]`` (breadth first); T = len(paths) + 1.

    Works level by level: one ``expand`` call per depth on that level's nodes that have
    children (K = the most such nodes on any level; shorter levels are padded by repeating
    a real node; workspace = the tree). Ranks index the top-k order of the candidates
    (greedy), or with ``temperature > 0`` and a ``key`` the order of sampling without
    replacement from softmax(logits / temperature), drawn by Gumbel-top-k; then
    ``sampled=True`` and ``draft_dist`` ([B, T, V], V = ``vocab_size`` or C) holds q of
    every node with children. A rank beyond the valid candidates gives a padding node (and
    so do its descendants).

    Returns:
      (tree, carry).
    """
    paths = normalize_paths(paths)
    mode = draft_mode(key, temperature)
    root = root.astype(jnp.int32)
    b, t = root.shape[0], len(paths) + 1
    index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
    parent_s = np.array([-1] + [index[p[:-1]] for p in paths], np.int32)
    depth_s = np.array([0] + [len(p) for p in paths], np.int32)
    anc_s = np.eye(t, dtype=bool)
    for i in range(1, t):
        anc_s[i] |= anc_s[parent_s[i]]
    pad_rows = padding_rows(t)
    max_depth = int(depth_s.max())
    has_children = np.zeros(t, bool)
    has_children[parent_s[1:]] = True
    frontiers = [np.flatnonzero(has_children & (depth_s == d)) for d in range(max_depth)]
    k_max = max(len(f) for f in frontiers)

    tokens = jnp.zeros((b, t), jnp.int32).at[:, 0].set(root)
    valid = jnp.zeros((b, t), bool).at[:, 0].set(True)
    logp = jnp.zeros((b, t), jnp.float32)
    score = jnp.zeros((b, t), jnp.float32)
    expanded_q, expanded_nodes = [], []
    for d, front in enumerate(frontiers):
        slot_of = {int(n): s for s, n in enumerate(front)}
        front_p = np.concatenate([front, np.full(k_max - len(front), front[-1])]).astype(np.int32)
        ok = valid[:, front_p]  # [B, K]
        rows = jnp.where(ok[:, :, None], anc_s[front_p], pad_rows[front_p])
        positions = jnp.where(ok, int(d), 1).astype(jnp.int32)
        carry, ids, logits = expand(carry, tokens[:, front_p], positions,
                                    jnp.broadcast_to(jnp.asarray(front_p), (b, k_max)), rows, d)
        kids = np.flatnonzero(depth_s == d + 1)
        slot = np.array([slot_of[int(parent_s[c])] for c in kids], np.int32)
        rank = np.array([paths[c - 1][-1] for c in kids], np.int32)
        k = jax.random.fold_in(mode.key, d) if mode.sampled else None
        ch = draft_children(ids, logits, int(rank.max()) + 1, mode, k)
        kid_ok = valid[:, parent_s[kids]] & jnp.isfinite(ch.logq[:, slot, rank])
        tokens = tokens.at[:, kids].set(jnp.where(kid_ok, ch.ids[:, slot, rank], 0))
        valid = valid.at[:, kids].set(kid_ok)
        logp = logp.at[:, kids].set(ch.logq[:, slot, rank])
        score = score.at[:, kids].set(score[:, parent_s[kids]] + ch.logq[:, slot, rank])
        if mode.sampled:
            n = len(front)  # only real frontier entries: padding repeats would add twice
            expanded_q.append(dense_dist(ids[:, :n], ch.cand_q[:, :n],
                                          candidate_vocab(vocab_size, ids.shape[-1])))
            expanded_nodes.append(front)
    dist = None
    if mode.sampled:
        rows_dense = jnp.concatenate(expanded_q, axis=1)  # [B, E, V]
        nodes = np.concatenate(expanded_nodes)
        dist = jnp.zeros((b, t, rows_dense.shape[-1]), jnp.float32).at[:, nodes].set(rows_dense)
    tree = finish_tree(tokens, jnp.broadcast_to(jnp.asarray(parent_s), (b, t)),
                   jnp.broadcast_to(jnp.asarray(depth_s), (b, t)), valid,
                   jnp.broadcast_to(jnp.asarray(anc_s), (b, t, t)), logp, score, dist,
                   mode.sampled)
    return tree, carry


@dataclasses.dataclass(frozen=True)
class StaticBuilder:
    """A fixed tree given as child-rank paths (``spec.paths``), as Medusa and EAGLE-1 use."""

    samples_children: ClassVar[bool] = True
    skips_expansions: ClassVar[bool] = False

    def prepare(self, spec: TreeSpec) -> dict[str, Any]:
        return {"paths": normalize_paths(spec.paths)}

    def num_nodes(self, spec: TreeSpec) -> int:
        return len(spec.paths) + 1

    def max_depth(self, spec: TreeSpec) -> int:
        return max(map(len, spec.paths))

    def workspace(self, spec: TreeSpec) -> int:
        return len(spec.paths) + 1

    def build(self, spec: TreeSpec, expand: ExpandFn, carry: Carry, root: Array,
              key: Array | None, temperature: float | Array,
              vocab_size: int) -> tuple[DraftTree, Carry]:
        return build_static(expand, carry, root, spec.paths, key=key, temperature=temperature,
                            vocab_size=vocab_size)


register("static", StaticBuilder())
