"""The chain builder: one drafted child per node, ``depth`` deep."""

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
    candidate_vocab,
    dense_dist,
    draft_children,
    draft_mode,
    finish_tree,
    padding_rows,
)
from specjax.tree.spec import TreeSpec, register


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
    mode = draft_mode(key, temperature)
    root = root.astype(jnp.int32)
    b, t = root.shape[0], depth + 1
    tril = jnp.asarray(np.tril(np.ones((t, t), bool)))
    pad_rows = jnp.asarray(padding_rows(t))

    tok, ok = root, jnp.ones((b,), bool)
    ys = []
    for s in range(depth):  # unrolled: candidate capacity C may differ per step
        row = jnp.where(ok[:, None], tril[s], pad_rows[s])  # [B, T] node s's ancestors
        pos = jnp.full((b, 1), s, jnp.int32)
        carry, ids, logits = expand(carry, tok[:, None], jnp.where(ok[:, None], pos, 1),
                                    jnp.full((b, 1), s, jnp.int32), row[:, None, :], s)
        k = jax.random.fold_in(mode.key, s) if mode.sampled else None
        ch = draft_children(ids, logits, 1, mode, k)
        child_ok = ok & jnp.isfinite(ch.logq[:, 0, 0])
        dist = (dense_dist(ids, ch.cand_q, candidate_vocab(vocab_size, ids.shape[-1]))[:, 0]
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
    tree = finish_tree(tokens, jnp.broadcast_to(arange - 1, (b, t)),
                       jnp.broadcast_to(arange, (b, t)), valid, jnp.broadcast_to(tril, (b, t, t)),
                       draft_logp, jnp.cumsum(draft_logp, axis=1), dist, mode.sampled)
    return tree, carry


@dataclasses.dataclass(frozen=True)
class ChainBuilder:
    """A chain of ``spec.depth`` drafts: one child per node."""

    samples_children: ClassVar[bool] = True
    skips_expansions: ClassVar[bool] = False

    def prepare(self, spec: TreeSpec) -> dict[str, Any]:
        return {}

    def num_nodes(self, spec: TreeSpec) -> int:
        return spec.depth + 1

    def max_depth(self, spec: TreeSpec) -> int:
        return spec.depth

    def workspace(self, spec: TreeSpec) -> int:
        return spec.depth + 1

    def build(self, spec: TreeSpec, expand: ExpandFn, carry: Carry, root: Array,
              key: Array | None, temperature: float | Array,
              vocab_size: int) -> tuple[DraftTree, Carry]:
        return build_chain(expand, carry, root, spec.depth, key=key, temperature=temperature,
                           vocab_size=vocab_size)


register("chain", ChainBuilder())
