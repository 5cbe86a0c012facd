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
nothing later matches. So one pass over i does the whole walk: a ``fori_loop`` with a fixed
trip count for greedy verification, whose steps are cheap, and for sampling a ``while_loop``
that stops once no row has a candidate left (a valid child of its current node at or after
i), since each of its steps may update distributions over the whole vocabulary.

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


def _pick(x: Array, tok: Array) -> Array:
    """x[b, tok[b]] for x [B, V], tok [B]."""
    return jnp.take_along_axis(x, tok[:, None], axis=1)[:, 0]


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
    # Without q (deterministic children) a [B, 1] placeholder rides in the carry.
    dists = draft_dist.astype(jnp.float32) if use_q else jnp.zeros((b, t, 1), jnp.float32)
    nodes = jnp.arange(t)

    # The walk carries p and q unnormalised, as weights P, Q [B, V] and their masses zp, zq
    # [B] (p = P / zp, q = Q / zq; zq = 0: no q left), so that a rejection costs two passes
    # over the vocabulary for each (the residual and its mass) and no normalising pass. A
    # node's own rows are distributions already: mass 1 (or 0 for a q never expanded).
    def q_mass(q_rows: Array) -> Array:
        return jnp.where(jnp.sum(q_rows, axis=-1) > 0, 1.0, 0.0)

    def step(carry):
        i, cur, path, n, p, zp, q, zq = carry
        tok = tree_tokens[:, i]
        tried = valid[:, i] & (parent[:, i] == cur)
        is_fixed = None if fixed is None else fixed[:, i]  # [B]
        px = _pick(p, tok) / zp
        if use_q:
            # DySpec's algorithm 3: once the draft residual is all zeros, no sibling is left
            # that q could have drawn; stop trying the sampled children of this node.
            has_q = zq > 0
            tried = tried & (has_q if is_fixed is None else has_q | is_fixed)
            qx = _pick(q, tok) / jnp.where(has_q, zq, 1.0)
            # q(x) = 0 only if the caller's q is not the law x was drawn from; keep it finite.
            ratio = jnp.where(qx > 0, px / jnp.where(qx > 0, qx, 1.0), (px > 0).astype(p.dtype))
            accept_prob = jnp.minimum(ratio, 1.0)
            if is_fixed is not None:  # deterministic drafts: the point-mass rule below
                accept_prob = jnp.where(is_fixed, px, accept_prob)
        else:
            accept_prob = px
        accept = tried & (coins[:, i] < accept_prob)
        reject = tried & ~accept
        cur, path, n = _accept(i, accept, cur, path, n)

        def rejected(p, zp, q, zq):
            """The residuals after x = tok is rejected, in the rows that rejected."""
            at_x = jnp.arange(p.shape[-1])[None, :] == tok[:, None]
            # The point-mass rule: p without x. Zero mass iff p was a point mass on x, and
            # then a rejection had probability 0: p is kept rather than divided by zero.
            rest = jnp.where(at_x, 0.0, p)
            if use_q:
                # max(p - q, 0); zero mass likewise means p == q, a rejection of
                # probability 0. Deterministic drafts take the point-mass rule, q unchanged.
                # (Reciprocals: a division per id costs several multiplications.)
                inv_zq = 1.0 / jnp.where(zq > 0, zq, 1.0)
                resid = jnp.maximum(p * (1.0 / zp)[:, None] - q * inv_zq[:, None], 0.0)
                rest = resid if is_fixed is None else jnp.where(is_fixed[:, None], rest, resid)
                sampled = reject if is_fixed is None else reject & ~is_fixed
                q = jnp.where(sampled[:, None] & at_x, 0.0, q)
                mass = jnp.sum(q, axis=-1)
                zq = jnp.where(sampled, jnp.where(mass > 1e-30, mass, 0.0), zq)
            mass = jnp.sum(rest, axis=-1)
            moved = reject & (mass > 1e-30)
            return jnp.where(moved[:, None], rest, p), jnp.where(moved, mass, zp), q, zq

        def accepted(p, zp, q, zq):
            """Node i's own distributions, in the rows that accepted it."""
            p_i = jax.lax.dynamic_index_in_dim(probs, i, axis=1, keepdims=False)
            q_i = jax.lax.dynamic_index_in_dim(dists, i, axis=1, keepdims=False)
            return (jnp.where(accept[:, None], p_i, p), jnp.where(accept, 1.0, zp),
                    jnp.where(accept[:, None], q_i, q), jnp.where(accept, q_mass(q_i), zq))

        # The vocabulary-wide updates run only where some row needs them: a step that
        # accepts skips the residuals, one that only rejects skips the switch to the child.
        def unchanged(*state):
            return state

        state = (p, zp, q, zq)
        state = jax.lax.cond(jnp.any(reject), rejected, unchanged, *state)
        state = jax.lax.cond(jnp.any(accept), accepted, unchanged, *state)
        return (i + 1, cur, path, n, *state)

    def may_try(carry):
        """Whether some row still has a candidate from node i on (a valid child of its
        current node); once none has, no later step could change anything."""
        i, cur = carry[0], carry[1]
        return (i < t) & jnp.any(valid & (parent == cur[:, None]) & (nodes >= i))

    init = (jnp.int32(1), jnp.zeros((b,), jnp.int32), _empty_path(b, t),
            jnp.zeros((b,), jnp.int32),
            probs[:, 0], jnp.ones((b,)), dists[:, 0], q_mass(dists[:, 0]))
    _, _, path, n, p, _, _, _ = jax.lax.while_loop(may_try, step, init)
    bonus = draw(k_bonus, p)  # draw() takes unnormalised weights
    return Acceptance(path=path, num_accepted=n, bonus=bonus)
