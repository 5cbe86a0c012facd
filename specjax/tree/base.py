"""Draft trees as fixed-shape arrays, and what every tree builder shares.

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
import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from specjax import pytree

Carry = Any
Paths = tuple[tuple[int, ...], ...]

NEG_INF = -jnp.inf


# --------------------------------------------------------------------------------------
# The tree
# --------------------------------------------------------------------------------------


@pytree.dataclass
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
      fixed: [B, T] bool or None: nodes drafted deterministically whatever ``sampled``
        says (a grafted lookup chain, :mod:`specjax.tree.lookup`; q's top children of a
        tree with ``greedy_children``), each after all its sampled siblings, so
        verification takes the point-mass rule for them; None: no such nodes.
    """

    tokens: Array
    parent: Array
    depth: Array
    valid: Array
    ancestors: Array
    draft_logp: Array
    score: Array
    draft_dist: Array | None = None
    sampled: bool = pytree.static_field(default=False)
    fixed: Array | None = None

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

    A builder's first call expands the root alone (node 0, ``step`` 0; K copies of it with
    padding). The speculative loop answers that call without running the drafter: the
    previous step's catch-up already read the root (``SpecState.root_h``).

    A builder whose ``skips_expansions`` is set (``dyspec-threshold``) makes every call
    after the root's inside ``lax.cond``: such calls must not leak traced values through
    trace-time side effects (Python lists); return what must survive in ``carry``.

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
class DraftMode:
    """Deterministic top-k drafting, or sampling without replacement at a temperature."""

    sampled: bool
    temperature: Array | None = None  # scalar, or [B] per row
    key: Array | None = None


def draft_mode(key: Array | None, temperature: float | Array) -> DraftMode:
    """Greedy for a Python ``temperature == 0``; sampling for > 0 or a traced temperature."""
    if isinstance(temperature, int | float | np.integer | np.floating):
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if temperature == 0:
            return DraftMode(sampled=False)
    if key is None:
        raise ValueError("sampled drafting (temperature > 0) needs a PRNG `key`")
    return DraftMode(sampled=True, temperature=jnp.asarray(temperature, jnp.float32), key=key)


@pytree.dataclass
class Children:
    ids: Array  # [B, K, n] int32 children in drafted order
    logq: Array  # [B, K, n] log q of each child (-inf: invalid candidate)
    rank_value: Array  # [B, K, n] logq made non-increasing along the drafted order
    cand_q: Array | None  # [B, K, C] q over the candidates (sampled only)


def log_softmax(logits: Array) -> Array:
    """log_softmax over the last axis that maps -inf to -inf (and all -inf to all -inf)."""
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    lse = jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1, keepdims=True)) + m
    return jnp.where(jnp.isfinite(logits), logits - lse, NEG_INF)


def draft_children(cand_ids: Array, cand_logits: Array, n: int, mode: DraftMode,
                    key: Array | None, greedy: int = 0) -> Children:
    """The first ``n`` children of each frontier node, in drafted order.

    Deterministic: the top-n candidates by logit, q = softmax(logits).
    Sampled: Gumbel-top-n over log q, q = softmax(logits / temperature); the order of the
    perturbed values is exactly the order of sampling n times without replacement from q.
    With ``greedy`` = g > 0 (sampled only), the last g children are q's top g, drafted
    deterministically, and the first n - g are sampled without replacement from q' = q
    without them (Hu et al., 2025's greedy multi-draft): ``cand_q`` is then q', the law
    the sampled children were drawn from, and the verifier must take the point-mass rule
    for the last g (:attr:`DraftTree.fixed`), after their sampled siblings.
    """
    c = cand_ids.shape[-1]
    if n > c:
        raise ValueError(f"cannot draft {n} children per node from C={c} candidates; "
                         f"top_k / child ranks must be <= C")
    if not 0 <= greedy < n:
        raise ValueError(f"greedy children must be in [0, {n}) of {n} children, got {greedy}")
    logits = cand_logits.astype(jnp.float32)
    if mode.sampled:
        t = mode.temperature
        t = t[:, None, None] if t.ndim == 1 else t
        logits = logits / t
    logq = log_softmax(logits)
    cand_q = None
    if mode.sampled:
        sample_logq = logq  # the law the sampled children are drawn from
        if greedy:
            _, top = jax.lax.top_k(logq, greedy)
            is_top = jnp.any(jnp.arange(c) == top[..., None], axis=-2)
            sample_logq = log_softmax(jnp.where(is_top, NEG_INF, logq))
        g = jax.random.gumbel(key, logits.shape, jnp.float32)
        order_by = jnp.where(jnp.isfinite(sample_logq), sample_logq + g, NEG_INF)
        # lax.top_k puts the lower index first on ties, so the drafted order is deterministic.
        _, pos = jax.lax.top_k(order_by, n - greedy)
        # Each child's log-probability under the law it was drafted from: q' for the
        # sampled ones, q itself for q's top ones.
        child_logq = jnp.take_along_axis(sample_logq, pos, axis=-1)
        if greedy:
            pos = jnp.concatenate([pos, top], axis=-1)
            child_logq = jnp.concatenate(
                [child_logq, jnp.take_along_axis(logq, top, axis=-1)], axis=-1)
        cand_q = jnp.exp(sample_logq)
    else:
        _, pos = jax.lax.top_k(logits, n)
        child_logq = jnp.take_along_axis(logq, pos, axis=-1)
    ids = jnp.take_along_axis(cand_ids.astype(jnp.int32), pos, axis=-1)
    # A running minimum along the drafted order: the identity for top-k order; for sampled
    # order it keeps a selection by cumulative value from taking a later-sampled sibling
    # without an earlier one (kept siblings stay a prefix of the sampling order), and it
    # only looks at siblings drafted so far.
    rank_value = jax.lax.cummin(child_logq, axis=child_logq.ndim - 1)
    return Children(ids, child_logq, rank_value, cand_q)


def dense_dist(ids: Array, q: Array, vocab: int) -> Array:
    """Scatter candidate probabilities [B, N, C] at ids into [B, N, V] (ids >= V dropped)."""
    b, n, _ = ids.shape
    out = jnp.zeros((b, n, vocab), jnp.float32)
    return out.at[jnp.arange(b)[:, None, None], jnp.arange(n)[None, :, None], ids].add(
        q, mode="drop")


def padding_rows(t: int) -> np.ndarray:
    """[T, T] ancestor rows of padding nodes: ``{0, i}`` (root and self)."""
    rows = np.eye(t, dtype=bool)
    rows[:, 0] = True
    return rows


def finish_tree(tokens: Array, parent: Array, depth: Array, valid: Array, ancestors: Array,
            draft_logp: Array, score: Array, draft_dist: Array | None,
            sampled: bool, fixed: Array | None = None) -> DraftTree:
    """Canonicalise padding nodes (token 0, parent 0, depth 1, -inf log-probs, not fixed)."""
    t = tokens.shape[1]
    valid = valid.at[:, 0].set(True)
    is_root = jnp.arange(t) == 0
    tree = DraftTree(
        tokens=jnp.where(valid, tokens, 0).astype(jnp.int32),
        parent=jnp.where(is_root, -1, jnp.where(valid, parent, 0)).astype(jnp.int32),
        depth=jnp.where(is_root, 0, jnp.where(valid, depth, 1)).astype(jnp.int32),
        valid=valid,
        ancestors=jnp.where(valid[:, :, None], ancestors, jnp.asarray(padding_rows(t))),
        draft_logp=jnp.where(is_root, 0.0, jnp.where(valid, draft_logp, NEG_INF)),
        score=jnp.where(is_root, 0.0, jnp.where(valid, score, NEG_INF)),
        draft_dist=None if draft_dist is None else jnp.where(valid[:, :, None], draft_dist, 0.0),
        sampled=sampled,
        fixed=None if fixed is None else fixed & valid & ~is_root,
    )
    return tree


def candidate_vocab(vocab_size: int | None, c: int) -> int:
    """The width of a dense q: the vocabulary when known, else the candidates' ``c`` (a
    head that scores ids 0..c-1)."""
    return c if vocab_size is None else int(vocab_size)
