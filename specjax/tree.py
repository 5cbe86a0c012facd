"""Draft trees as fixed-shape arrays, and the builders that draft them.

A :class:`DraftTree` holds ``T`` nodes per batch row. Node 0 is the *root*: the last
committed token, which is not yet in the target's KV cache, so the target's verification
pass runs over all ``T`` nodes and its output at node ``i`` predicts the token after the
path root -> i. Nodes ``1..T-1`` are drafted tokens.

Layout invariants every builder guarantees (verification relies on them):

* parents come before children: ``parent[b, i] < i``; the root has parent ``-1``;
* ``depth[b, i] == depth[b, parent[b, i]] + 1``; so ``positions = prefix_len + depth``;
* siblings appear in index order = the order in which they were drafted: top-k order for
  deterministic drafting, the order of sampling *without replacement* for stochastic drafting;
* the builders here emit a breadth-first layout: valid nodes by depth, then by their
  parent's index, then by drafting rank (EAGLE's ``sorted(paths, key=(len, path))``);
* padding nodes (``valid == False``) are never accepted: they have token 0, parent 0 and
  depth 1, and no valid node lists them in its ``ancestors`` row; a padding node's own row
  is ``{0, i}`` so that every attention row stays non-empty.

Builders draft from an abstract drafter step, :class:`ExpandFn`, so they do not depend on
a drafter model. Everything is a pure function of arrays with static structure arguments
(depth, top_k, total_tokens, paths), so a builder can run inside ``jax.jit`` and inside
the decoding ``lax.while_loop``; nothing branches in Python on traced values.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

Carry = Any
Paths = tuple[tuple[int, ...], ...]

_NEG_INF = -jnp.inf


# --------------------------------------------------------------------------------------
# The tree
# --------------------------------------------------------------------------------------


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["tokens", "parent", "depth", "valid", "ancestors", "draft_logp", "score",
                 "draft_dist"],
    meta_fields=["sampled"],
)
@dataclasses.dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees with ``T`` nodes each (a registered pytree).

    Attributes:
      tokens: [B, T] int32 token ids; ``tokens[:, 0]`` is the root (last committed token).
      parent: [B, T] int32; ``parent[:, 0] == -1`` and ``parent[b, i] < i``.
      depth: [B, T] int32; ``depth[:, 0] == 0``, a child is its parent's depth + 1.
      valid: [B, T] bool; padding nodes are False and are never accepted.
      ancestors: [B, T, T] bool; ``ancestors[b, i, j]`` is ``j == i`` or ``j`` an ancestor
        of ``i``: the target's tree-attention block mask.
      draft_logp: [B, T] float32 log q of node i's token under its parent's draft
        distribution (root: 0; padding: -inf).
      score: [B, T] float32 cumulative ``draft_logp`` along the path (root: 0; padding: -inf).
      draft_dist: [B, T, V] float32 when ``sampled``: ``q_u``, the distribution node u's
        children were drawn from (zeros for nodes that were never expanded); else None.
      sampled: static; children were drawn by sampling without replacement from q
        (stochastic drafting) rather than taken in deterministic top-k order.
    """

    tokens: Array
    parent: Array
    depth: Array
    valid: Array
    ancestors: Array
    draft_logp: Array
    score: Array
    draft_dist: Array | None = None
    sampled: bool = False

    @property
    def num_nodes(self) -> int:
        """T, the static number of nodes per row (root included)."""
        return self.tokens.shape[-1]

    def packed_ancestors(self) -> Array:
        """[B, T, ceil(T/32)] uint32 bitmask of ``ancestors`` (bit j%32 of word j//32)."""
        return pack_ancestors(self.ancestors)


def pack_ancestors(ancestors: Array) -> Array:
    """Pack a [..., T, T] bool mask into [..., T, ceil(T/32)] uint32 words.

    Bit ``j % 32`` of word ``j // 32`` is column ``j`` (FR-Spec packs its tree masks into
    uint64 the same way; uint32 keeps to JAX's default 32-bit types).
    """
    t = ancestors.shape[-1]
    words = max(1, math.ceil(t / 32))
    pad = words * 32 - t
    bits = jnp.pad(ancestors, [(0, 0)] * (ancestors.ndim - 1) + [(0, pad)]).astype(jnp.uint32)
    bits = bits.reshape(ancestors.shape[:-1] + (words, 32))
    # Distinct bits never carry, so a sum is a bitwise OR.
    return jnp.sum(bits << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)


def unpack_ancestors(packed: Array, num_nodes: int) -> Array:
    """Inverse of :func:`pack_ancestors`: [..., T, W] uint32 -> [..., T, num_nodes] bool."""
    j = jnp.arange(num_nodes)
    words = jnp.take(packed, j // 32, axis=-1)
    return ((words >> (j % 32).astype(jnp.uint32)) & 1).astype(bool)


def tree_positions(tree: DraftTree, prefix_len: Array) -> Array:
    """RoPE positions of the tree's nodes: [B, T] = ``prefix_len[:, None] + depth``.

    ``prefix_len`` [B] is the number of committed tokens already in the target's cache, so
    the root (the last committed token, not yet cached) sits at position ``prefix_len``.
    """
    return prefix_len[:, None].astype(jnp.int32) + tree.depth


def ancestors_from_parent(parent: Array, max_depth: int) -> Array:
    """[B, T, T] ancestor-or-self mask from a parent array [B, T].

    Follows parent pointers ``max_depth`` times (static), so it is exact for trees whose
    nodes are at depth <= ``max_depth``; pointers stop at the root.
    """
    b, t = parent.shape
    cur = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    anc = jnp.zeros((b, t, t), bool)
    for _ in range(max_depth + 1):
        anc = anc | jax.nn.one_hot(cur, t, dtype=bool)
        cur = jnp.where(cur > 0, jnp.take_along_axis(parent, cur, axis=1), 0)
    return anc


# --------------------------------------------------------------------------------------
# The drafter step the builders call
# --------------------------------------------------------------------------------------


class ExpandFn(Protocol):
    """One drafter step over ``K`` frontier nodes per row.

    Args:
      carry: opaque drafter state (its KV cache, hidden states), threaded through.
      tokens: [B, K] int32 the frontier nodes' tokens.
      positions: [B, K] int32 the nodes' depths (the caller adds the prefix length).
      node_idx: [B, K] int32 the nodes' indices in the builder's *workspace* of
        ``N = ancestors.shape[-1]`` nodes: the tree itself for :func:`build_chain` and
        :func:`build_static` (N = T), the expansion slots for :func:`build_eagle2`
        (N = 1 + (depth-1)*top_k: root, then ``top_k`` beam nodes per level). A drafter
        writes its per-node state (K/V) at ``node_idx`` and may size that scratch by N.
      ancestors: [B, K, N] bool, each frontier node's ancestor-or-self row over the
        workspace: which nodes (all expanded earlier, or itself) it may attend to.
      step: static int, the draft step t of the children being drafted (0 for the root's
        children, i.e. the depth of the expanded nodes). Builders call ``expand`` from a
        Python loop, one call per step, so a vocabulary head may size its candidate
        buffer by ``step`` (position-aware budgets) and C may differ between calls.

    Frontier padding repeats a real frontier node of the same call (same token, position,
    index and row), so a drafter may compute and write it like any other entry; the
    builder ignores its output.

    Returns:
      (carry, cand_ids [B, K, C] int32, cand_logits [B, K, C] float32): candidate next
      tokens (real vocabulary ids, distinct within a row of C) and their logits, -inf for
      invalid candidates. C is the full vocabulary or a shortlist capacity.
    """

    def __call__(self, carry: Carry, tokens: Array, positions: Array, node_idx: Array,
                 ancestors: Array, step: int) -> tuple[Carry, Array, Array]: ...


# --------------------------------------------------------------------------------------
# Drafting children from one expansion
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Mode:
    """Deterministic top-k drafting, or sampling without replacement at a temperature."""

    sampled: bool
    temperature: Array | None = None  # scalar, or [B] per row
    key: Array | None = None


def _mode(key: Array | None, temperature: float | Array) -> _Mode:
    """Greedy for a Python ``temperature == 0``; sampling for > 0 or a traced temperature."""
    if isinstance(temperature, int | float | np.integer | np.floating):
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if temperature == 0:
            return _Mode(sampled=False)
    if key is None:
        raise ValueError("sampled drafting (temperature > 0) needs a PRNG `key`")
    return _Mode(sampled=True, temperature=jnp.asarray(temperature, jnp.float32), key=key)


class _Children(NamedTuple):
    ids: Array  # [B, K, n] int32 children in drafted order
    logq: Array  # [B, K, n] log q of each child (-inf: invalid candidate)
    rank_value: Array  # [B, K, n] logq made non-increasing along the drafted order
    cand_q: Array | None  # [B, K, C] q over the candidates (sampled only)


def _log_softmax(logits: Array) -> Array:
    """log_softmax over the last axis that maps -inf to -inf (and all -inf to all -inf)."""
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    lse = jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1, keepdims=True)) + m
    return jnp.where(jnp.isfinite(logits), logits - lse, _NEG_INF)


def _draft_children(cand_ids: Array, cand_logits: Array, n: int, mode: _Mode,
                    key: Array | None) -> _Children:
    """The first ``n`` children of each frontier node, in drafted order.

    Deterministic: the top-n candidates by logit, q = softmax(logits).
    Sampled: Gumbel-top-n over log q, q = softmax(logits / temperature); the order of the
    perturbed values is exactly the order of sampling n times without replacement from q.
    """
    c = cand_ids.shape[-1]
    if n > c:
        raise ValueError(f"cannot draft {n} children per node from C={c} candidates; "
                         f"top_k / child ranks must be <= C")
    logits = cand_logits.astype(jnp.float32)
    if mode.sampled:
        t = mode.temperature
        t = t[:, None, None] if t.ndim == 1 else t
        logits = logits / t
    logq = _log_softmax(logits)
    if mode.sampled:
        g = jax.random.gumbel(key, logits.shape, jnp.float32)
        order_by = jnp.where(jnp.isfinite(logq), logq + g, _NEG_INF)
    else:
        order_by = logits
    # lax.top_k puts the lower index first on ties, so the drafted order is deterministic.
    _, pos = jax.lax.top_k(order_by, n)
    ids = jnp.take_along_axis(cand_ids.astype(jnp.int32), pos, axis=-1)
    child_logq = jnp.take_along_axis(logq, pos, axis=-1)
    # A running minimum along the drafted order: the identity for top-k order; for sampled
    # order it keeps a selection by cumulative value from taking a later-sampled sibling
    # without an earlier one (kept siblings stay a prefix of the sampling order), and it
    # only looks at siblings drafted so far.
    rank_value = jax.lax.cummin(child_logq, axis=child_logq.ndim - 1)
    return _Children(ids, child_logq, rank_value, jnp.exp(logq) if mode.sampled else None)


def _dense_dist(ids: Array, q: Array, vocab: int) -> Array:
    """Scatter candidate probabilities [B, N, C] at ids into [B, N, V] (ids >= V dropped)."""
    b, n, _ = ids.shape
    out = jnp.zeros((b, n, vocab), jnp.float32)
    return out.at[jnp.arange(b)[:, None, None], jnp.arange(n)[None, :, None], ids].add(
        q, mode="drop")


def _padding_rows(t: int) -> np.ndarray:
    """[T, T] ancestor rows of padding nodes: ``{0, i}`` (root and self)."""
    rows = np.eye(t, dtype=bool)
    rows[:, 0] = True
    return rows


def _finish(tokens: Array, parent: Array, depth: Array, valid: Array, ancestors: Array,
            draft_logp: Array, score: Array, draft_dist: Array | None,
            sampled: bool) -> DraftTree:
    """Canonicalise padding nodes (token 0, parent 0, depth 1, -inf log-probs)."""
    t = tokens.shape[1]
    valid = valid.at[:, 0].set(True)
    is_root = jnp.arange(t) == 0
    tree = DraftTree(
        tokens=jnp.where(valid, tokens, 0).astype(jnp.int32),
        parent=jnp.where(is_root, -1, jnp.where(valid, parent, 0)).astype(jnp.int32),
        depth=jnp.where(is_root, 0, jnp.where(valid, depth, 1)).astype(jnp.int32),
        valid=valid,
        ancestors=jnp.where(valid[:, :, None], ancestors, jnp.asarray(_padding_rows(t))),
        draft_logp=jnp.where(is_root, 0.0, jnp.where(valid, draft_logp, _NEG_INF)),
        score=jnp.where(is_root, 0.0, jnp.where(valid, score, _NEG_INF)),
        draft_dist=None if draft_dist is None else jnp.where(valid[:, :, None], draft_dist, 0.0),
        sampled=sampled,
    )
    return tree


def _vocab(vocab_size: int | None, c: int) -> int:
    return c if vocab_size is None else int(vocab_size)


# --------------------------------------------------------------------------------------
# Chain
# --------------------------------------------------------------------------------------


def build_chain(expand: ExpandFn, carry: Carry, root: Array, depth: int, *,
                key: Array | None = None, temperature: float | Array = 0.0,
                vocab_size: int | None = None) -> tuple[DraftTree, Carry]:
    """A single draft sequence of ``depth`` tokens: T = depth + 1 nodes.

    Calls ``expand`` ``depth`` times (K = 1; workspace = the tree), unrolled.
    Greedy (``temperature == 0``) takes the argmax candidate, with ``draft_logp`` from
    softmax(logits). With ``temperature > 0`` (a float, or a traced scalar / [B] array) and
    a ``key`` it samples from softmax(cand_logits / temperature), sets ``sampled=True`` and
    fills ``draft_dist`` ([B, T, V], V = ``vocab_size`` or C; the leaf row is zeros).

    Args:
      root: [B] int the last committed token of each row.
    Returns:
      (tree, carry).
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    mode = _mode(key, temperature)
    root = root.astype(jnp.int32)
    b, t = root.shape[0], depth + 1
    tril = jnp.asarray(np.tril(np.ones((t, t), bool)))
    pad_rows = jnp.asarray(_padding_rows(t))

    tok, ok = root, jnp.ones((b,), bool)
    ys = []
    for s in range(depth):  # unrolled: candidate capacity C may differ per step
        row = jnp.where(ok[:, None], tril[s], pad_rows[s])  # [B, T] node s's ancestors
        pos = jnp.full((b, 1), s, jnp.int32)
        carry, ids, logits = expand(carry, tok[:, None], jnp.where(ok[:, None], pos, 1),
                                    jnp.full((b, 1), s, jnp.int32), row[:, None, :], s)
        k = jax.random.fold_in(mode.key, s) if mode.sampled else None
        ch = _draft_children(ids, logits, 1, mode, k)
        child_ok = ok & jnp.isfinite(ch.logq[:, 0, 0])
        dist = (_dense_dist(ids, ch.cand_q, _vocab(vocab_size, ids.shape[-1]))[:, 0]
                if mode.sampled else None)
        ys.append((ch.ids[:, 0, 0], ch.logq[:, 0, 0], child_ok, dist))
        tok, ok = jnp.where(child_ok, ch.ids[:, 0, 0], 0), child_ok

    ids, logq, ok = (jnp.stack([y[i] for y in ys], axis=1) for i in range(3))  # [B, depth]
    tokens = jnp.concatenate([root[:, None], ids], axis=1)
    valid = jnp.concatenate([jnp.ones((b, 1), bool), ok], axis=1)
    draft_logp = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), logq], axis=1)
    dist = None
    if mode.sampled:
        dist = jnp.stack([y[3] for y in ys], axis=1)  # [B, depth, V]
        dist = jnp.concatenate([dist, jnp.zeros_like(dist[:, :1])], axis=1)
    arange = jnp.arange(t, dtype=jnp.int32)
    tree = _finish(tokens, jnp.broadcast_to(arange - 1, (b, t)), jnp.broadcast_to(arange, (b, t)),
                   valid, jnp.broadcast_to(tril, (b, t, t)), draft_logp,
                   jnp.cumsum(draft_logp, axis=1), dist, mode.sampled)
    return tree, carry


# --------------------------------------------------------------------------------------
# Static tree (Medusa / EAGLE-1 path lists)
# --------------------------------------------------------------------------------------


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
    mode = _mode(key, temperature)
    root = root.astype(jnp.int32)
    b, t = root.shape[0], len(paths) + 1
    index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
    parent_s = np.array([-1] + [index[p[:-1]] for p in paths], np.int32)
    depth_s = np.array([0] + [len(p) for p in paths], np.int32)
    anc_s = np.eye(t, dtype=bool)
    for i in range(1, t):
        anc_s[i] |= anc_s[parent_s[i]]
    pad_rows = _padding_rows(t)
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
        ch = _draft_children(ids, logits, int(rank.max()) + 1, mode, k)
        kid_ok = valid[:, parent_s[kids]] & jnp.isfinite(ch.logq[:, slot, rank])
        tokens = tokens.at[:, kids].set(jnp.where(kid_ok, ch.ids[:, slot, rank], 0))
        valid = valid.at[:, kids].set(kid_ok)
        logp = logp.at[:, kids].set(ch.logq[:, slot, rank])
        score = score.at[:, kids].set(score[:, parent_s[kids]] + ch.logq[:, slot, rank])
        if mode.sampled:
            n = len(front)  # only real frontier entries: padding repeats would add twice
            expanded_q.append(_dense_dist(ids[:, :n], ch.cand_q[:, :n],
                                          _vocab(vocab_size, ids.shape[-1])))
            expanded_nodes.append(front)
    dist = None
    if mode.sampled:
        rows_dense = jnp.concatenate(expanded_q, axis=1)  # [B, E, V]
        nodes = np.concatenate(expanded_nodes)
        dist = jnp.zeros((b, t, rows_dense.shape[-1]), jnp.float32).at[:, nodes].set(rows_dense)
    tree = _finish(tokens, jnp.broadcast_to(jnp.asarray(parent_s), (b, t)),
                   jnp.broadcast_to(jnp.asarray(depth_s), (b, t)), valid,
                   jnp.broadcast_to(jnp.asarray(anc_s), (b, t, t)), logp, score, dist,
                   mode.sampled)
    return tree, carry


# --------------------------------------------------------------------------------------
# EAGLE-2 dynamic tree
# --------------------------------------------------------------------------------------


def eagle2_sizes(top_k: int, depth: int) -> tuple[int, int]:
    """(workspace, pool) of :func:`build_eagle2`.

    workspace = 1 + (depth - 1) * top_k expanded nodes (the root, then a beam of ``top_k``
    per level but the last): the ``N`` the drafter sees. pool = top_k + (depth - 1) *
    top_k**2 drafted candidates, from which ``total_tokens`` are selected.
    """
    return 1 + (depth - 1) * top_k, top_k + (depth - 1) * top_k * top_k


def build_eagle2(expand: ExpandFn, carry: Carry, root: Array, *, top_k: int = 10,
                 depth: int = 7, total_tokens: int = 60, key: Array | None = None,
                 temperature: float | Array = 0.0,
                 vocab_size: int | None = None) -> tuple[DraftTree, Carry]:
    """EAGLE-2's dynamic draft tree (context-aware, chosen by cumulative draft log-prob).

    1. Expand the root: its ``top_k`` children are the first beam and the first pool
       entries, with value = log q.
    2. ``depth - 1`` more times (unrolled): expand the beam (K = top_k); each beam
       node drafts ``top_k`` children (top_k**2 candidates) whose cumulative value is the
       parent's plus log q(child); all enter the pool; the ``top_k`` best become the beam.
    3. Select the ``total_tokens`` best pool entries by cumulative value, lay them out
       breadth first (parents before children, siblings in drafted order) after the root:
       T = total_tokens + 1.

    Conventions (differences from SafeAILab/EAGLE ``cnets1.topK_genrate``):

    * ``depth`` counts ``expand`` calls = draft levels = the deepest draft node's depth,
      as in :func:`build_chain`. EAGLE's code expands the root and then loops ``depth``
      times, so its depth d is our ``depth = d + 1``;
    * ``total_tokens`` counts drafted nodes, the root excluded; EAGLE's ``total_token`` n
      counts the root too (its constructor stores n - 1), so it is our ``total_tokens = n - 1``.
      EAGLE's defaults (total_token=60, depth=7, top_k=10) are ours (59, 8, 10).
    * The workspace ``expand`` sees is the expansion slots (``eagle2_sizes``): the root
      is slot 0 and the beam of level l (l = 1..depth-1) is slots 1 + (l-1)*top_k + j; a
      beam node's ancestors row lists the slots of its beam ancestors (EAGLE's tree_mask).
    * Beams are kept in pool order (not value order), which gives the breadth-first layout.
    * Ties: values never increase from parent to child (log q <= 0, and float rounding
      is monotone), and every selection takes the lower pool index first on equal values
      (``lax.top_k``); a parent's pool index is below its children's, and siblings sit
      in drafted order, so the selection is ancestor-closed and each node's kept children
      are a prefix of its drafted order even with ties.
    * Candidates with -inf logits give -inf values; selected ones become padding nodes.

    Sampling (``temperature > 0`` with a ``key``): each expanded node draws its ``top_k``
    children by Gumbel-top-k over log q / temperature, i.e. ``top_k`` samples without
    replacement from q = softmax(logits / temperature), in sampling order; the perturbed
    log-probs rank the siblings. The value a child adds to its path is the running minimum
    of log q over its siblings up to it in sampling order (equal to its log q when the
    sampling order is also the order of q, always true for greedy), so a selection by
    cumulative value keeps a prefix of each node's sampling order while values stay on the
    log-q scale (raw Gumbel-perturbed values would not: the largest of them is
    Gumbel(0)-distributed whatever q is). ``score`` and ``draft_logp`` still hold the true
    log q. ``sampled=True`` and ``draft_dist`` ([B, T, V], V = ``vocab_size`` or C) holds q
    of every expanded node (zeros for nodes never expanded).
    Caveat for verification: how many sampled children a node keeps depends on the q of
    drafted tokens (their own and, through the beam and the global cut, other nodes'), so
    a kept child is not distributed exactly as a fresh draw from q given its earlier
    siblings; multi-draft rejection sampling on this tree is close to, but not provably,
    lossless. The chain and static builders fix the structure in advance and are exact.

    Args:
      root: [B] int the last committed token of each row.
      top_k, depth, total_tokens: static ints; total_tokens <= pool size.
    Returns:
      (tree, carry).
    """
    if top_k < 1 or depth < 1 or total_tokens < 1:
        raise ValueError(f"top_k, depth and total_tokens must be >= 1, got {top_k}, {depth}, "
                         f"{total_tokens}")
    workspace, pool = eagle2_sizes(top_k, depth)
    if total_tokens > pool:
        raise ValueError(f"total_tokens={total_tokens} exceeds the {pool} candidates that "
                         f"top_k={top_k}, depth={depth} draft (top_k + (depth-1)*top_k**2)")
    mode = _mode(key, temperature)
    root = root.astype(jnp.int32)
    b = root.shape[0]
    kk = top_k * top_k
    bi = jnp.arange(b)[:, None]

    # Level 1: the root's children, all of which form the first beam.
    rows0 = jnp.zeros((b, 1, workspace), bool).at[:, :, 0].set(True)
    zeros = jnp.zeros((b, 1), jnp.int32)
    carry, ids0, logits0 = expand(carry, root[:, None], zeros, zeros, rows0, 0)
    ch0 = _draft_children(ids0, logits0, top_k,
                          mode, jax.random.fold_in(mode.key, 0) if mode.sampled else None)
    beam = (
        jnp.broadcast_to(1 + jnp.arange(top_k, dtype=jnp.int32), (b, top_k)),  # pool index
        ch0.ids[:, 0],  # tokens
        ch0.rank_value[:, 0],  # cumulative selection value
        ch0.logq[:, 0],  # cumulative log q
        jnp.broadcast_to(rows0, (b, top_k, workspace)),  # the parent's ancestor row
    )

    def level(state, i: int):
        """Expand the beam of level i + 1 (depth i + 1) into level i + 2 of the pool."""
        dcarry, (b_pool, b_tok, b_val, b_score, b_rows) = state
        slots = 1 + i * top_k + jnp.arange(top_k, dtype=jnp.int32)
        rows = b_rows | jax.nn.one_hot(slots, workspace, dtype=bool)[None]
        dcarry, ids, logits = expand(dcarry, b_tok, jnp.full((b, top_k), i + 1, jnp.int32),
                                     jnp.broadcast_to(slots, (b, top_k)), rows, i + 1)
        k = jax.random.fold_in(mode.key, i + 1) if mode.sampled else None
        ch = _draft_children(ids, logits, top_k, mode, k)
        c_tok = ch.ids.reshape(b, kk)
        c_val = (b_val[:, :, None] + ch.rank_value).reshape(b, kk)
        c_score = (b_score[:, :, None] + ch.logq).reshape(b, kk)
        c_parent = jnp.repeat(b_pool, top_k, axis=1)
        base = 1 + top_k + i * kk
        # The next beam: the top_k values (lower index first on ties), kept in pool order.
        sel = jnp.sort(jax.lax.top_k(c_val, top_k)[1], axis=1)
        nxt = (base + sel, jnp.take_along_axis(c_tok, sel, 1), jnp.take_along_axis(c_val, sel, 1),
               jnp.take_along_axis(c_score, sel, 1), rows[bi, sel // top_k])
        out = (c_tok, c_val, c_score, ch.logq.reshape(b, kk), c_parent, b_pool)
        if mode.sampled:
            out += (_dense_dist(ids, ch.cand_q, _vocab(vocab_size, ids.shape[-1])),)
        return (dcarry, nxt), out

    # Unrolled (depth is small): the candidate capacity C may differ per level.
    outs, state = [], (carry, beam)
    for i in range(depth - 1):
        state, out = level(state, i)
        outs.append(out)
    carry = state[0]
    levels = depth - 1
    if outs:
        ys = [jnp.stack(y) for y in zip(*outs, strict=True)]  # [levels, B, ...]
    else:  # depth 1: the pool is the root's children only
        f32, i32 = jnp.float32, jnp.int32
        ys = [jnp.zeros((0, b, kk), dt) for dt in (i32, f32, f32, f32, i32)]
        ys.append(jnp.zeros((0, b, top_k), i32))

    def flat(y: Array) -> Array:  # [L, B, X, ...] -> [B, L*X, ...]
        y = jnp.moveaxis(y, 0, 1)
        return y.reshape((b, -1) + y.shape[3:])

    # The pool: index 0 is the root, 1..top_k level 1, then top_k**2 per level.
    pool_tok = jnp.concatenate([root[:, None], ch0.ids[:, 0], flat(ys[0])], axis=1)
    pool_val = jnp.concatenate([jnp.zeros((b, 1)), ch0.rank_value[:, 0], flat(ys[1])], axis=1)
    pool_score = jnp.concatenate([jnp.zeros((b, 1)), ch0.logq[:, 0], flat(ys[2])], axis=1)
    pool_logq = jnp.concatenate([jnp.zeros((b, 1)), ch0.logq[:, 0], flat(ys[3])], axis=1)
    pool_parent = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32),
                                   jnp.zeros((b, top_k), jnp.int32), flat(ys[4])], axis=1)
    pool_depth = jnp.asarray(np.repeat(np.arange(depth + 1), [1, top_k] + [kk] * levels))

    # Select, and lay out by pool index: breadth first, siblings in drafted order.
    sel = 1 + jnp.sort(jax.lax.top_k(pool_val[:, 1:], total_tokens)[1], axis=1)
    nodes = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), sel.astype(jnp.int32)], axis=1)
    t = total_tokens + 1
    final_of_pool = jnp.zeros((b, pool + 1), jnp.int32).at[bi, nodes].set(
        jnp.arange(t, dtype=jnp.int32))
    parent = jnp.take_along_axis(final_of_pool, jnp.take_along_axis(pool_parent, nodes, 1), 1)
    valid = jnp.isfinite(jnp.take_along_axis(pool_val, nodes, 1))
    # Padding parents may be unselected; canonicalise before following pointers.
    parent = jnp.where(valid, parent, 0).at[:, 0].set(-1)

    dist = None
    if mode.sampled:
        # Workspace slot of each expanded pool node (root: slot 0), -1 if never expanded.
        expanded = flat(ys[5])  # [B, (depth-1)*top_k] pool indices of the expanded beams
        slot_of_pool = jnp.full((b, pool + 1), -1, jnp.int32).at[:, 0].set(0)
        slot_of_pool = slot_of_pool.at[bi, expanded].set(
            1 + jnp.arange(levels * top_k, dtype=jnp.int32))
        ws_q = _dense_dist(ids0, ch0.cand_q, _vocab(vocab_size, ids0.shape[-1]))
        if levels:
            ws_q = jnp.concatenate([ws_q, flat(ys[6])], axis=1)  # [B, workspace, V]
        slot = jnp.take_along_axis(slot_of_pool, nodes, 1)  # [B, T]
        dist = jnp.take_along_axis(ws_q, jnp.clip(slot, 0)[:, :, None], 1) \
            * (slot >= 0)[:, :, None]

    tree = _finish(jnp.take_along_axis(pool_tok, nodes, 1), parent,
                   jnp.take(pool_depth, nodes), valid, ancestors_from_parent(parent, depth),
                   jnp.take_along_axis(pool_logq, nodes, 1),
                   jnp.take_along_axis(pool_score, nodes, 1), dist, mode.sampled)
    return tree, carry
