"""Verifying a draft tree against the target: which path is accepted, and the bonus token.

A tree of T nodes (see ``specjax.tree``) has node 0 as the root, the last committed token,
and draft nodes 1..T-1 with ``parent[i] < i``. The target scores every node in one forward;
``target_logits[b, i]`` / ``target_probs[b, i]`` is the target's prediction of the token
*after* node i. Both verifiers walk from the root, visiting the children of the current node
in index order (the order they were drafted), and stop at the first node none of whose
children is accepted. That node's prediction (or, when sampling, the residual left after
its rejected children) gives one extra token, the bonus.

Because parents precede children and siblings are in index order, the walk is one pass over
node indices 1..T-1: node i is *considered* iff it is valid and its parent is the current
node. After accepting i, the later siblings of i no longer match (their parent is not i) and
the children of i all come later; after the last child of the current node is rejected,
nothing later matches. So a ``fori_loop`` over i with a fixed trip count does the whole walk.

Everything is batched over B rows and jittable; ``sampled`` and ``assume_q_one`` are static.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from specjax import pytree
from specjax.sampling import draw, first_argmax

NO_NODE = -1  # Path slots after the end of a row's accepted path.


@pytree.dataclass
class Acceptance:
    """The outcome of verifying one tree per batch row.

    The tokens committed this step are ``tokens[path[1:1 + num_accepted]]`` followed by
    ``bonus``: ``num_accepted + 1`` tokens (see :func:`committed_tokens`).
    """

    path: Array  # [B, T] int32 accepted node indices, path[:, 0] = 0 (root), NO_NODE after.
    num_accepted: Array  # [B] int32 accepted draft nodes, 0..T-1 (the root is not counted).
    bonus: Array  # [B] int32 the token drawn from the target after the last accepted node.


def committed_tokens(tree_tokens: Array, acc: Acceptance) -> tuple[Array, Array]:
    """The tokens one step commits, left-aligned.

    Args:
      tree_tokens: [B, T] int32 tree tokens.
      acc: the verifier's result.
    Returns:
      (tokens [B, T] int32: accepted drafts then the bonus, NO_NODE after; count [B] int32,
      ``num_accepted + 1``).
    """
    t = tree_tokens.shape[1]
    drafts = jnp.take_along_axis(tree_tokens, jnp.clip(acc.path[:, 1:], 0), axis=1)  # [B, T-1]
    slot = jnp.arange(t)[None, :]
    n = acc.num_accepted[:, None]
    padded = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)  # [B, T]
    out = jnp.where(slot < n, padded, jnp.where(slot == n, acc.bonus[:, None], NO_NODE))
    return out.astype(jnp.int32), (acc.num_accepted + 1).astype(jnp.int32)


def _empty_path(b: int, t: int) -> Array:
    return jnp.full((b, t), NO_NODE, jnp.int32).at[:, 0].set(0)


def _accept(i: Array, accept: Array, cur: Array, path: Array, n: Array):
    """Move the rows where ``accept`` holds to child node ``i`` and append it to the path."""
    b = path.shape[0]
    # Rows that do not accept write out of range, which mode="drop" discards.
    slot = jnp.where(accept, n + 1, path.shape[1])
    path = path.at[jnp.arange(b), slot].set(i, mode="drop")
    return jnp.where(accept, i, cur), path, n + accept.astype(jnp.int32)


def verify_greedy(tree_tokens: Array, parent: Array, valid: Array,
                  target_logits: Array) -> Acceptance:
    """Greedy verification: follow the target's argmax from the root.

    A child is accepted iff its token equals the target's argmax at its parent; among several
    matching children (only possible with duplicate siblings) the first in index order wins.

    Args:
      tree_tokens: [B, T] int32.
      parent: [B, T] int32, parent[:, 0] = -1, parent[b, i] < i.
      valid: [B, T] bool; invalid (padding) nodes are never accepted.
      target_logits: [B, T, V]; row i predicts the token after node i.
    Returns:
      The accepted path, its length, and ``bonus`` = argmax at the last accepted node.
    """
    b, t = tree_tokens.shape
    # Not jnp.argmax: XLA:CPU runs its (value, index) reduction as a scalar loop, 1.50 ms over
    # a 14-node tree's 49,152-id rows against 0.26 ms for first_argmax (docs/benchmarks.md).
    best = first_argmax(target_logits)  # [B, T]

    def step(i, carry):
        cur, path, n = carry
        want = jnp.take_along_axis(best, cur[:, None], axis=1)[:, 0]
        accept = valid[:, i] & (parent[:, i] == cur) & (tree_tokens[:, i] == want)
        return _accept(i, accept, cur, path, n)

    init = (jnp.zeros((b,), jnp.int32), _empty_path(b, t), jnp.zeros((b,), jnp.int32))
    cur, path, n = jax.lax.fori_loop(1, t, step, init)
    bonus = jnp.take_along_axis(best, cur[:, None], axis=1)[:, 0]
    return Acceptance(path=path, num_accepted=n, bonus=bonus)


def _normalize(x: Array, fallback: Array) -> Array:
    """x / sum(x) over the last axis; ``fallback`` where the mass is (numerically) zero."""
    s = jnp.sum(x, axis=-1, keepdims=True)
    return jnp.where(s > 1e-30, x / jnp.where(s > 1e-30, s, 1.0), fallback)


def _pick(x: Array, tok: Array) -> Array:
    """x[b, tok[b]] for x [B, V], tok [B]."""
    return jnp.take_along_axis(x, tok[:, None], axis=1)[:, 0]


def _zero_at(x: Array, tok: Array) -> Array:
    return jnp.where(jnp.arange(x.shape[-1])[None, :] == tok[:, None], 0.0, x)


def verify_sampling(key: Array, tree_tokens: Array, parent: Array, valid: Array,
                    target_probs: Array, draft_dist: Array | None, *, sampled: bool,
                    assume_q_one: bool = False, fixed: Array | None = None) -> Acceptance:
    """Multi-draft rejection sampling over a tree (SpecInfer / Sequoia); lossless.

    At the current node u with target distribution p = target_probs[u], the valid children
    x_1, x_2, ... are tried in index order:

    * ``sampled`` (children drawn *without replacement* from q = draft_dist[u]): accept x_k
      with probability min(1, p(x_k) / q(x_k)); on rejection p <- norm(max(p - q, 0)) and
      q <- norm(q with x_k zeroed), which is the law of the next sibling given the previous
      ones. Each try is then an ordinary speculative-sampling step of the current p against
      the true law of x_k, so by induction the emitted token has law p.
    * deterministic children (``sampled=False``, or ``assume_q_one=True``): q is a point mass
      on x_k, so accept with probability p(x_k) and on rejection zero p(x_k) and renormalize.
      This is exact for *any* fixed list of distinct children.

    ``assume_q_one=True`` is EAGLE's rule applied to sampled children. Conditional on the
    drafted tree, the point-mass rule is exact whatever tokens the drafter picked, and the
    drafter's randomness is independent of the verifier's, so it is still lossless; it
    accepts less often than the q-aware rule (p(x) <= min(1, p(x)/q(x))). What is *not*
    lossless is the opposite mistake: ``sampled=True`` on children that were not drawn from
    ``draft_dist`` (e.g. top-k children); the tests show both.

    When no child of u is accepted (or u is a leaf), the bonus is drawn from the current p,
    the residual after u's rejected children (p itself at a leaf).

    Nodes marked ``fixed`` are deterministic drafts (a grafted lookup chain, q's top
    children of a greedy multi-draft) and take the point-mass rule in either mode; they do
    not change q. They come after all their siblings that take the q-aware rule: by then p
    is the law of the next token given the rejections so far, and a point-mass step on it
    is exact for any token fixed before the coins are drawn. After rejections of sampled
    x ~ q, p = norm(max(p - q, 0)) keeps all of p's mass on tokens q never draws (q's top
    children under a greedy multi-draft), which is why trying them last accepts more.

    Args:
      key: PRNG key (one for the whole batch).
      tree_tokens: [B, T] int32.
      parent: [B, T] int32, parent[:, 0] = -1, parent[b, i] < i.
      valid: [B, T] bool; invalid nodes are never tried.
      target_probs: [B, T, V] float, ``specjax.sampling.target_probs`` of the tree logits.
      draft_dist: [B, T, V] float or None: q_u, the law u's children were drawn from (zeros
        outside a shortlist is fine). Required iff ``sampled and not assume_q_one``.
      sampled: static; whether children were sampled without replacement from draft_dist.
      assume_q_one: static; use the point-mass rule even for sampled children (see above).
      fixed: [B, T] bool or None: the deterministic drafts (``DraftTree.fixed``).
    Returns:
      The accepted path, its length, and the bonus token.
    """
    use_q = sampled and not assume_q_one
    if use_q and draft_dist is None:
        raise ValueError("verify_sampling(sampled=True) needs draft_dist (the law children "
                         "were drawn from); pass assume_q_one=True for EAGLE's point-mass rule")
    b, t, _ = target_probs.shape
    k_coin, k_bonus = jax.random.split(key)
    coins = jax.random.uniform(k_coin, (b, t))  # coins[:, i] decides node i.
    probs = target_probs.astype(jnp.float32)
    dists = draft_dist.astype(jnp.float32) if use_q else None

    def step(i, carry):
        cur, path, n, p, q = carry
        tok = tree_tokens[:, i]
        tried = valid[:, i] & (parent[:, i] == cur)
        is_fixed = None if fixed is None else fixed[:, i]  # [B]
        px = _pick(p, tok)
        if use_q:
            # DySpec's algorithm 3: once the draft residual is all zeros, no sibling is left
            # that q could have drawn; stop trying the sampled children of this node.
            has_q = jnp.sum(q, axis=-1) > 0
            tried = tried & (has_q if is_fixed is None else has_q | is_fixed)
            qx = _pick(q, tok)
            # q(x) = 0 only if the caller's q is not the law x was drawn from; keep it finite.
            ratio = jnp.where(qx > 0, px / jnp.where(qx > 0, qx, 1.0), (px > 0).astype(p.dtype))
            accept_prob = jnp.minimum(ratio, 1.0)
            # Zero residual mass means p <= q everywhere, i.e. p == q and a rejection had
            # probability 0; keep p rather than dividing by zero.
            p_rej = _normalize(jnp.maximum(p - q, 0.0), p)
            q_rej = _normalize(_zero_at(q, tok), jnp.zeros_like(q))
            if is_fixed is not None:  # deterministic drafts: the point-mass rule below
                accept_prob = jnp.where(is_fixed, px, accept_prob)
                p_rej = jnp.where(is_fixed[:, None], _normalize(_zero_at(p, tok), p), p_rej)
                q_rej = jnp.where(is_fixed[:, None], q, q_rej)
        else:
            accept_prob = px
            p_rej = _normalize(_zero_at(p, tok), p)  # zero mass iff p was a point mass on x
            q_rej = q
        accept = tried & (coins[:, i] < accept_prob)
        reject = tried & ~accept
        cur, path, n = _accept(i, accept, cur, path, n)
        p_next = jax.lax.dynamic_index_in_dim(probs, i, axis=1, keepdims=False)
        p = jnp.where(accept[:, None], p_next, jnp.where(reject[:, None], p_rej, p))
        if use_q:
            q_next = jax.lax.dynamic_index_in_dim(dists, i, axis=1, keepdims=False)
            q = jnp.where(accept[:, None], q_next, jnp.where(reject[:, None], q_rej, q))
        return cur, path, n, p, q

    init = (jnp.zeros((b,), jnp.int32), _empty_path(b, t), jnp.zeros((b,), jnp.int32),
            probs[:, 0], dists[:, 0] if use_q else None)
    _, path, n, p, _ = jax.lax.fori_loop(1, t, step, init)
    bonus = draw(k_bonus, p)
    return Acceptance(path=path, num_accepted=n, bonus=bonus)
