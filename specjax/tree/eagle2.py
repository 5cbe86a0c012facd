"""EAGLE-2's dynamic tree: beam expansion, then the best drafts by cumulative log q."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from specjax.tree.base import (
    Carry,
    DraftTree,
    ExpandFn,
    ancestors_from_parent,
    candidate_vocab,
    dense_dist,
    draft_children,
    draft_mode,
    finish_tree,
)
from specjax.tree.spec import TreeSpec, register


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
    mode = draft_mode(key, temperature)
    root = root.astype(jnp.int32)
    b = root.shape[0]
    kk = top_k * top_k
    bi = jnp.arange(b)[:, None]

    # Level 1: the root's children, all of which form the first beam.
    rows0 = jnp.zeros((b, 1, workspace), bool).at[:, :, 0].set(True)
    zeros = jnp.zeros((b, 1), jnp.int32)
    carry, ids0, logits0 = expand(carry, root[:, None], zeros, zeros, rows0, 0)
    ch0 = draft_children(ids0, logits0, top_k,
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
        ch = draft_children(ids, logits, top_k, mode, k)
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
            out += (dense_dist(ids, ch.cand_q, candidate_vocab(vocab_size, ids.shape[-1])),)
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
        ws_q = dense_dist(ids0, ch0.cand_q, candidate_vocab(vocab_size, ids0.shape[-1]))
        if levels:
            ws_q = jnp.concatenate([ws_q, flat(ys[6])], axis=1)  # [B, workspace, V]
        slot = jnp.take_along_axis(slot_of_pool, nodes, 1)  # [B, T]
        dist = jnp.take_along_axis(ws_q, jnp.clip(slot, 0)[:, :, None], 1) \
            * (slot >= 0)[:, :, None]

    tree = finish_tree(jnp.take_along_axis(pool_tok, nodes, 1), parent,
                   jnp.take(pool_depth, nodes), valid, ancestors_from_parent(parent, depth),
                   jnp.take_along_axis(pool_logq, nodes, 1),
                   jnp.take_along_axis(pool_score, nodes, 1), dist, mode.sampled)
    return tree, carry


@dataclasses.dataclass(frozen=True)
class Eagle2Builder:
    """EAGLE-2's dynamic tree: ``spec.depth`` expansions of a ``spec.top_k`` beam, then the
    ``spec.total_tokens`` best drafts by cumulative log-probability.

    Children are taken top-k even when sampling (``samples_children`` is False): nodes are
    kept by their drafted values, so sampled children would not be draws from q. The
    verifier then uses the point-mass rule, exact for any candidate list chosen
    independently of its coins.
    """

    samples_children: ClassVar[bool] = False
    skips_expansions: ClassVar[bool] = False

    def prepare(self, spec: TreeSpec) -> dict[str, Any]:
        pool = eagle2_sizes(spec.top_k, spec.depth)[1]
        if spec.total_tokens > pool:
            raise ValueError(f"total_tokens={spec.total_tokens} exceeds the {pool} candidates "
                             f"of an EAGLE-2 tree with top_k={spec.top_k}, depth={spec.depth}")
        return {}

    def num_nodes(self, spec: TreeSpec) -> int:
        return spec.total_tokens + 1

    def max_depth(self, spec: TreeSpec) -> int:
        return spec.depth

    def workspace(self, spec: TreeSpec) -> int:
        return eagle2_sizes(spec.top_k, spec.depth)[0]

    def build(self, spec: TreeSpec, expand: ExpandFn, carry: Carry, root: Array,
              key: Array | None, temperature: float | Array,
              vocab_size: int) -> tuple[DraftTree, Carry]:
        return build_eagle2(expand, carry, root, top_k=spec.top_k, depth=spec.depth,
                            total_tokens=spec.total_tokens, vocab_size=vocab_size)


register("eagle2", Eagle2Builder())
