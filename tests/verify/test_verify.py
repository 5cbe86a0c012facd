"""Tree verification: exact greedy paths, and lossless multi-draft rejection sampling."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from specjax.sampling import StaticSampling, draw, target_probs
from specjax.verify import NO_NODE, committed_tokens, verify_greedy, verify_sampling

# ---------------------------------------------------------------------------------------------
# Greedy verification on hand-made trees.
#
#   node:    0    1    2    3    4    5    6    7
#   parent: -1    0    0    0    1    1    2    6        0 ─┬─ 1 ─┬─ 4
#   token:  10   11   12   13   14   15   16   17           │     └─ 5
#                                                          ├─ 2 ── 6 ── 7
#                                                          └─ 3
# ---------------------------------------------------------------------------------------------
PARENT = [-1, 0, 0, 0, 1, 1, 2, 6]
TOKENS = [10, 11, 12, 13, 14, 15, 16, 17]
V = 32


def _logits(argmax: list[int]) -> np.ndarray:
    """[T, V] logits whose argmax at node i is argmax[i] (ties impossible)."""
    out = np.random.RandomState(len(argmax)).uniform(-1, 0, (len(argmax), V)).astype(np.float32)
    out[np.arange(len(argmax)), argmax] = 5.0
    return out


def _greedy(rows: list[dict]):
    """Run verify_greedy on a batch of rows given as dicts of tokens/parent/valid/argmax."""
    tokens = jnp.asarray([r.get("tokens", TOKENS) for r in rows], jnp.int32)
    parent = jnp.asarray([r.get("parent", PARENT) for r in rows], jnp.int32)
    valid = jnp.asarray([r.get("valid", [True] * 8) for r in rows], bool)
    logits = jnp.asarray(np.stack([_logits(r["argmax"]) for r in rows]))
    acc = jax.jit(verify_greedy)(tokens, parent, valid, logits)
    return acc, tokens


def _pad(path: list[int], t: int = 8) -> list[int]:
    return path + [NO_NODE] * (t - len(path))


def test_greedy_hand_made_trees():
    rows = [
        # Full depth through the second sibling: 0 -> 2 -> 6 -> 7, bonus from node 7.
        dict(argmax=[12, 0, 16, 0, 0, 0, 17, 20]),
        # Nothing matches at the root.
        dict(argmax=[25, 11, 12, 13, 14, 15, 16, 17]),
        # The target wants node 3's token but node 3 is padding.
        dict(argmax=[13, 0, 0, 0, 0, 0, 0, 0], valid=[True] * 3 + [False] + [True] * 4),
        # Duplicate siblings 4 and 5 (both 14): the first in index order wins; 4 is a leaf.
        dict(argmax=[11, 14, 0, 0, 21, 22, 0, 0], tokens=[10, 11, 12, 13, 14, 14, 16, 17]),
        # Stop in the middle: node 6 matches, node 7 does not.
        dict(argmax=[12, 0, 16, 0, 0, 0, 3, 0]),
        # A match below an invalid node is unreachable (6, 7 invalid; 2 accepted).
        dict(argmax=[12, 0, 16, 0, 0, 0, 17, 0], valid=[True] * 6 + [False] * 2),
    ]
    acc, tokens = _greedy(rows)
    assert np.asarray(acc.path).tolist() == [
        _pad([0, 2, 6, 7]), _pad([0]), _pad([0]), _pad([0, 1, 4]), _pad([0, 2, 6]), _pad([0, 2])]
    assert np.asarray(acc.num_accepted).tolist() == [3, 0, 0, 2, 2, 1]
    assert np.asarray(acc.bonus).tolist() == [20, 25, 13, 21, 3, 16]
    out, count = committed_tokens(tokens, acc)
    assert np.asarray(count).tolist() == [4, 1, 1, 3, 3, 2]
    assert np.asarray(out)[0].tolist() == [12, 16, 17, 20, NO_NODE, NO_NODE, NO_NODE, NO_NODE]
    assert np.asarray(out)[3].tolist() == [11, 14, 21] + [NO_NODE] * 5


def test_greedy_chain_full_acceptance():
    """A chain (T = 5) accepted to its end commits T tokens."""
    t = 5
    acc, _ = _greedy([dict(tokens=[1, 2, 3, 4, 5], parent=[-1, 0, 1, 2, 3], valid=[True] * t,
                           argmax=[2, 3, 4, 5, 9])])
    assert np.asarray(acc.path).tolist() == [[0, 1, 2, 3, 4]]
    assert int(acc.num_accepted[0]) == 4 and int(acc.bonus[0]) == 9


def _random_trees(rs: np.random.RandomState, b: int, t: int, vocab: int):
    """Random well-formed trees (valid subtrees closed under parents) with a small vocab."""
    parent = np.full((b, t), -1, np.int32)
    valid = np.ones((b, t), bool)
    for i in range(1, t):
        parent[:, i] = rs.randint(0, i, b)
        valid[:, i] = valid[np.arange(b), parent[:, i]] & (rs.rand(b) < 0.85)
    tokens = rs.randint(0, vocab, (b, t)).astype(np.int32)
    return jnp.asarray(tokens), jnp.asarray(parent), jnp.asarray(valid)


def test_sampling_with_one_hot_target_equals_greedy():
    """With a point-mass target (temperature 0), the sampling rules reduce to greedy."""
    rs = np.random.RandomState(0)
    b, t, vocab = 64, 12, 3
    tokens, parent, valid = _random_trees(rs, b, t, vocab)
    logits = jnp.asarray(rs.randn(b, t, vocab).astype(np.float32))
    probs = target_probs(logits, StaticSampling(greedy=True, top_k=0, use_top_p=False),
                         jnp.float32(1), jnp.float32(1))
    want = verify_greedy(tokens, parent, valid, logits)
    for kw in (dict(sampled=False), dict(sampled=True, assume_q_one=True)):
        got = verify_sampling(jax.random.key(1), tokens, parent, valid, probs, None, **kw)
        for name in ("path", "num_accepted", "bonus"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert int(want.num_accepted.max()) >= 2  # the trees do get accepted deeply


def test_sampling_never_accepts_invalid_nodes():
    """Padding nodes carrying the target's only token are skipped; the bonus is that token."""
    b = 256
    tokens = jnp.asarray([[0, 1, 2, 5]] * b, jnp.int32)
    parent = jnp.asarray([[-1, 0, 0, 0]] * b, jnp.int32)
    valid = jnp.asarray([[True, True, True, False]] * b)
    probs = jnp.zeros((b, 4, 6)).at[:, :, 5].set(1.0)  # the target always says 5
    q = jnp.full((b, 4, 6), 1 / 6)
    for kw in (dict(sampled=False, draft_dist=None), dict(sampled=True, draft_dist=q)):
        dist = kw.pop("draft_dist")
        acc = verify_sampling(jax.random.key(0), tokens, parent, valid, probs, dist, **kw)
        assert not np.asarray(acc.num_accepted).any()
        assert (np.asarray(acc.bonus) == 5).all()


def test_sampling_needs_draft_dist():
    z = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="draft_dist"):
        verify_sampling(jax.random.key(0), z, z, z > 0, jnp.ones((1, 2, 3)) / 3, None,
                        sampled=True)


# ---------------------------------------------------------------------------------------------
# Statistical losslessness.
#
# A synthetic Markov "language": the target's next-token law after token x is P[x] and the
# drafter's is Q[x] (Q is far from P and zero outside a 5-token shortlist). The tree is a root
# with 3 children drawn from Q[root], each with 2 children drawn from Q[child], plus two
# padding nodes carrying the target's favourite tokens. Two consecutive steps give the first
# two committed tokens, whose joint law must be P[r](x1) P[x1](x2).
# ---------------------------------------------------------------------------------------------
SV, ROOT, N = 7, 0, 20_000
SPARENT = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3, 0, 1]
SVALID = [True] * 10 + [False] * 2


def _markov_tables() -> tuple[np.ndarray, np.ndarray]:
    rs = np.random.RandomState(0)
    p = rs.dirichlet(np.full(SV, 2.0), size=SV)
    # The drafter prefers what the target dislikes, within a 5-token shortlist per row.
    q = (1.0 / p) ** 2
    q[np.arange(SV)[:, None], np.argsort(q, axis=1)[:, :2]] = 0.0
    return p.astype(np.float32), (q / q.sum(1, keepdims=True)).astype(np.float32)


def _draft(key: jax.Array, root: jax.Array, q: jax.Array, p: jax.Array, sampled: bool):
    """Tree tokens [B, 12]: children without replacement from Q (Gumbel top-k) or top-k."""
    def children(k, par, n):
        scores = jnp.log(q[par])
        if sampled:
            scores = scores + jax.random.gumbel(k, scores.shape)
        return jax.lax.top_k(scores, n)[1]

    k1, k2 = jax.random.split(key)
    c1 = children(k1, root, 3)  # [B, 3]
    c2 = children(k2, c1.reshape(-1), 2).reshape(-1, 6)  # [B, 6]: kids of 1, 2, 3 in order
    pads = jnp.stack([jnp.argmax(p[root], -1), jnp.argmax(p[c1[:, 0]], -1)], axis=1)
    return jnp.concatenate([root[:, None], c1, c2, pads], axis=1).astype(jnp.int32)


def _verify_step(key, root, p, q, *, draft_sampled, sampled, assume_q_one):
    kd, kv = jax.random.split(key)
    tokens = _draft(kd, root, q, p, draft_sampled)
    b, t = tokens.shape
    parent = jnp.broadcast_to(jnp.asarray(SPARENT, jnp.int32), (b, t))
    valid = jnp.broadcast_to(jnp.asarray(SVALID), (b, t))
    # The target's probabilities go through the library's own sampling transform.
    probs = target_probs(jnp.log(p[tokens]), StaticSampling(False, 0, False), jnp.float32(1),
                         jnp.float32(1))
    acc = verify_sampling(kv, tokens, parent, valid, probs, q[tokens], sampled=sampled,
                          assume_q_one=assume_q_one)
    return tokens, acc


@partial(jax.jit, static_argnames=("draft_sampled", "sampled", "assume_q_one"))
def _first_two(key, p, q, *, draft_sampled, sampled, assume_q_one):
    """(first token [N], second token [N], draft tokens accepted in step 1 [N])."""
    kw = dict(draft_sampled=draft_sampled, sampled=sampled, assume_q_one=assume_q_one)
    k1, k2 = jax.random.split(key)
    root = jnp.full((N,), ROOT, jnp.int32)
    tokens1, acc1 = _verify_step(k1, root, p, q, **kw)
    out1, count1 = committed_tokens(tokens1, acc1)
    # Rows that committed a single token need the next step (rooted at their bonus).
    tokens2, acc2 = _verify_step(k2, acc1.bonus, p, q, **kw)
    out2, _ = committed_tokens(tokens2, acc2)
    second = jnp.where(count1 >= 2, out1[:, 1], out2[:, 0])
    return out1[:, 0], second, acc1.num_accepted


def _pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit, pooling cells expected below 5 counts into one."""
    counts = np.bincount(samples, minlength=probs.size).astype(float)
    expected = probs.ravel().astype(float) * samples.size
    expected *= samples.size / expected.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep]).pvalue)


def _fit(seed: int, **kw) -> tuple[float, float, float]:
    """p-values of the first token and of the first two tokens, and the mean acceptance."""
    p, q = _markov_tables()
    first, second, accepted = map(np.asarray, _first_two(jax.random.key(seed), jnp.asarray(p),
                                                         jnp.asarray(q), **kw))
    joint = p[ROOT][:, None] * p  # [x1, x2]
    return (_pvalue(first, p[ROOT]), _pvalue(first * SV + second, joint),
            float(accepted.mean()))


def test_sampled_drafts_are_lossless():
    p1, p2, mean_acc = _fit(0, draft_sampled=True, sampled=True, assume_q_one=False)
    assert p1 > 1e-3 and p2 > 1e-3, (p1, p2)
    assert mean_acc > 0.3  # the tree is actually accepted into, not just resampled


def test_deterministic_topk_drafts_are_lossless():
    p1, p2, mean_acc = _fit(1, draft_sampled=False, sampled=False, assume_q_one=False)
    assert p1 > 1e-3 and p2 > 1e-3, (p1, p2)
    assert mean_acc > 0.15  # Q's top-k are what P dislikes, so this accepts less


def test_sampled_rule_on_topk_drafts_is_biased():
    """Negative control: the test has power. Claiming top-k children were drawn from Q
    (sampled=True on a deterministic draft) skews the output far from P."""
    p1, p2, _ = _fit(2, draft_sampled=False, sampled=True, assume_q_one=False)
    assert p1 < 1e-6 and p2 < 1e-6, (p1, p2)


def test_assume_q_one_is_lossless_but_accepts_less():
    """EAGLE's point-mass rule on sampled children: exact given the drawn tree (and so
    lossless overall), but it accepts less than the q-aware rule on the same draws."""
    p1, p2, mean_one = _fit(3, draft_sampled=True, sampled=True, assume_q_one=True)
    assert p1 > 1e-3 and p2 > 1e-3, (p1, p2)
    _, _, mean_q = _fit(3, draft_sampled=True, sampled=True, assume_q_one=False)
    # num_accepted is in {0, 1, 2}: its standard error over N rows is below 1 / sqrt(N).
    assert mean_q - mean_one > 6 / np.sqrt(N), (mean_q, mean_one)


def test_greedy_multidraft_is_exact_and_needs_the_point_mass_rule():
    """A root with one child sampled from q' (q without its top token) and q's top token as
    a fixed child tried after it (Hu et al., 2025): the first token follows p, a child is
    accepted with probability p(top) + sum_{y != top} min(p(y), q'(y)), and verifying the
    top child as if it were sampled (no ``fixed``) accepts it whenever it has mass: biased."""
    v, n = 6, N
    p = np.array([0.30, 0.25, 0.20, 0.10, 0.10, 0.05], np.float32)
    q = np.array([0.50, 0.05, 0.05, 0.20, 0.15, 0.05], np.float32)
    top = int(np.argmax(q))
    q_rest = np.where(np.arange(v) == top, 0.0, q) / (1 - q[top])
    x = jax.random.categorical(jax.random.key(5), jnp.log(jnp.asarray(q_rest)), shape=(n,))
    tokens = jnp.stack([jnp.zeros(n, jnp.int32), x.astype(jnp.int32),
                        jnp.full(n, top, jnp.int32)], axis=1)
    parent = jnp.broadcast_to(jnp.asarray([-1, 0, 0], jnp.int32), (n, 3))
    valid = jnp.ones((n, 3), bool)
    probs = jnp.broadcast_to(jnp.asarray(p), (n, 3, v))
    dist = jnp.zeros((n, 3, v), jnp.float32).at[:, 0].set(jnp.asarray(q_rest, jnp.float32))
    fixed = jnp.broadcast_to(jnp.asarray([False, False, True]), (n, 3))

    def first(fixed):
        acc = verify_sampling(jax.random.key(6), tokens, parent, valid, probs, dist,
                              sampled=True, fixed=fixed)
        out, _ = committed_tokens(tokens, acc)
        return np.asarray(out[:, 0]), np.asarray(acc.num_accepted)

    tok, accepted = first(fixed)
    assert _pvalue(tok, p) > 1e-3
    want = p[top] + np.minimum(np.delete(p, top), np.delete(q_rest, top)).sum()
    assert abs(accepted.mean() - want) < 4 * np.sqrt(want * (1 - want) / n)
    wrong, _ = first(None)
    assert _pvalue(wrong, p) < 1e-6


# ---------------------------------------------------------------------------------------------
# The walk against its textbook form.
#
# verify_sampling stops once no row has a candidate left, updates p and q only in the branch a
# step needs, and carries them unnormalised. The reference below is the walk as the papers
# write it: every node in turn, p and q normalised after each rejection. With the same coins
# both must take the same decisions on every row (their arithmetic differs only in rounding).
# ---------------------------------------------------------------------------------------------
def _reference_walk(key, tokens, parent, valid, probs, dist, fixed):
    b, t, _ = probs.shape
    k_coin, k_bonus = jax.random.split(key)
    coins = jax.random.uniform(k_coin, (b, t))

    def norm(x, fallback):
        s = jnp.sum(x, -1, keepdims=True)
        return jnp.where(s > 1e-30, x / jnp.where(s > 1e-30, s, 1.0), fallback)

    def step(i, carry):
        cur, path, n, p, q = carry
        tok = tokens[:, i]
        pick = lambda x: jnp.take_along_axis(x, tok[:, None], 1)[:, 0]  # noqa: E731
        zero = lambda x: jnp.where(jnp.arange(x.shape[-1]) == tok[:, None], 0.0, x)  # noqa: E731
        tried = valid[:, i] & (parent[:, i] == cur) & ((jnp.sum(q, -1) > 0) | fixed[:, i])
        px, qx = pick(p), pick(q)
        ratio = jnp.where(qx > 0, px / jnp.where(qx > 0, qx, 1.0), (px > 0) * 1.0)
        accept_prob = jnp.where(fixed[:, i], px, jnp.minimum(ratio, 1.0))
        accept = tried & (coins[:, i] < accept_prob)
        reject = tried & ~accept
        p_rej = jnp.where(fixed[:, i, None], norm(zero(p), p), norm(jnp.maximum(p - q, 0), p))
        q_rej = jnp.where(fixed[:, i, None], q, norm(zero(q), jnp.zeros_like(q)))
        slot = jnp.where(accept, n + 1, t)
        path = path.at[jnp.arange(b), slot].set(i, mode="drop")
        p = jnp.where(accept[:, None], probs[:, i], jnp.where(reject[:, None], p_rej, p))
        q = jnp.where(accept[:, None], dist[:, i], jnp.where(reject[:, None], q_rej, q))
        return jnp.where(accept, i, cur), path, n + accept, p, q

    path0 = jnp.full((b, t), NO_NODE, jnp.int32).at[:, 0].set(0)
    init = (jnp.zeros(b, jnp.int32), path0, jnp.zeros(b, jnp.int32), probs[:, 0], dist[:, 0])
    _, path, n, p, _ = jax.lax.fori_loop(1, t, step, init)
    return path, n, draw(k_bonus, p)


def test_sampled_walk_takes_the_textbook_walks_decisions():
    """Random trees over a 40-token vocabulary, q zero outside a shortlist (and everywhere
    for some nodes), a fifth of the nodes fixed: the same path on each of 512 rows, and the
    same bonus token on all but a rounding's share of them (draw() searches unnormalised
    weights there, normalised here)."""
    rs = np.random.RandomState(7)
    b, t, v = 512, 10, 40
    _, parent, valid = _random_trees(rs, b, t, v)
    probs = jnp.asarray(rs.dirichlet(np.full(v, 0.3), size=(b, t)).astype(np.float32))
    q = rs.dirichlet(np.full(v, 0.3), size=(b, t))
    q[rs.rand(b, t, v) < 0.3] = 0.0  # a shortlist: zeros outside it
    q[:, :, 0] += 1e-3
    q /= q.sum(-1, keepdims=True)
    q[rs.rand(b, t) < 0.15] = 0.0  # nodes never expanded: no sampled child of theirs is tried
    q = jnp.asarray(q.astype(np.float32))
    # Siblings are distinct tokens (whose law does not matter to the decisions compared).
    order = np.stack([rs.permutation(v)[:t] for _ in range(t)])  # parent u's children
    parent_np = np.asarray(parent)
    rank = np.zeros((b, t), np.int32)
    for i in range(1, t):
        rank[:, i] = (parent_np[:, 1:i] == parent_np[:, i:i + 1]).sum(1)
    tokens = order[np.clip(parent_np, 0, None), rank].astype(np.int32)
    tokens[:, 0] = 0
    tokens = jnp.asarray(tokens)
    fixed = jnp.asarray(rs.rand(b, t) < 0.2)
    key = jax.random.key(11)
    got = verify_sampling(key, tokens, parent, valid, probs, q, sampled=True, fixed=fixed)
    want_path, want_n, want_bonus = _reference_walk(key, tokens, parent, valid, probs, q, fixed)
    np.testing.assert_array_equal(got.path, want_path)
    np.testing.assert_array_equal(got.num_accepted, want_n)
    assert float(np.mean(np.asarray(got.bonus) == np.asarray(want_bonus))) > 0.99
    assert 0.2 < float(np.mean(np.asarray(want_n) > 0)) < 0.95  # both outcomes are common
