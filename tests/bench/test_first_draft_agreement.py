"""examples/first_draft_agreement.py's split of a drafter's hits by where the target copies."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

_SCRIPT = Path(__file__).parents[2] / "examples" / "first_draft_agreement.py"
_spec = importlib.util.spec_from_file_location("first_draft_agreement", _SCRIPT)
fda = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fda)


def test_split_by_lookup_pools_each_kind_of_position_per_task():
    b = lambda *v: np.asarray(v, bool)  # noqa: E731
    hits = [b(1, 0, 1, 1), b(0, 0), b()]  # the third answer stopped at once
    look = [b(1, 1, 0, 0), b(1, 0), b()]
    got = fda.split_by_lookup(hits, look, ["qa", "rag", "qa"], ("qa", "rag", "math"))
    hit, miss = got["where_lookup_hits"], got["where_lookup_misses"]
    # Lookup right at 3 of 6 positions; the drafter is right at 1 of those, 2 of the rest.
    assert hit["share"] == pytest.approx(0.5) and miss["share"] == pytest.approx(0.5)
    assert hit["pooled"] == pytest.approx(1 / 3) and miss["pooled"] == pytest.approx(2 / 3)
    assert hit["per_task"] == {"qa": pytest.approx(0.5), "rag": 0.0, "math": None}
    assert miss["per_task"] == {"qa": 1.0, "rag": 0.0, "math": None}
    # The two parts partition the positions: their pooled hits add back to the whole.
    assert (hit["pooled"] * hit["share"] + miss["pooled"] * miss["share"]
            == pytest.approx(fda.pooled(hits)))


def test_sampled_acceptance_is_the_rejection_tests_acceptance_probability():
    rng = np.random.default_rng(0)
    v, d, n = 40, 8, 5
    head = rng.normal(size=(v, d)).astype(np.float32)
    f, h = rng.normal(size=(n, d)).astype(np.float32), rng.normal(size=(n, d)).astype(np.float32)

    def softmax(z):
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    for t in (1.0, 0.5):
        p, q = softmax(f @ head.T / t), softmax(h @ head.T / t)
        np.testing.assert_allclose(np.asarray(fda.sampled_acceptance(f, h, head, t)),
                                   np.minimum(p, q).sum(-1), rtol=1e-5)
    # A drafter that equals the target is always accepted over the whole vocabulary; over a
    # shortlist S its q is p renormalised on S (>= p there), so it is accepted with p(S).
    ids = np.arange(0, v, 3)
    np.testing.assert_allclose(np.asarray(fda.sampled_acceptance(f, f, head, 1.0)), 1.0,
                               rtol=1e-5)
    p = softmax(f @ head.T)
    np.testing.assert_allclose(np.asarray(fda.sampled_acceptance(f, f, head, 1.0, ids)),
                               p[:, ids].sum(-1), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(fda.sampled_acceptance(f, h, head, 1.0, np.arange(v))),
                               np.asarray(fda.sampled_acceptance(f, h, head, 1.0)), rtol=1e-5)


def test_pooled_weighs_expected_hits_by_position():
    assert fda.pooled([np.array([0.5, 0.25]), np.array([1.0])]) == pytest.approx(1.75 / 3)
    assert fda.pooled([np.zeros(0)]) is None


def _exact_two_children(p: np.ndarray, q: np.ndarray) -> float:
    """A root with two children drawn without replacement from q, verified by multi-draft
    rejection sampling: the first is accepted with sum min(p, q); after rejecting x the
    residual is norm(max(p - q, 0)) and the second child's law is q without x."""
    first = np.minimum(p, q).sum()
    resid = np.maximum(p - q, 0)
    resid = resid / resid.sum()
    second = 0.0
    for x in range(len(p)):
        rejected_x = max(q[x] - p[x], 0.0)  # q(x) (1 - min(1, p(x) / q(x)))
        if rejected_x == 0:
            continue
        q2 = np.where(np.arange(len(q)) == x, 0.0, q) / (1 - q[x])
        second += rejected_x * np.minimum(resid, q2).sum()
    return first + second


def _random_rows(seed: int, v: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n rows of a target distribution p [n, v] and drafter logits [n, v]."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(v, 0.7), size=n).astype(np.float32)
    logits = rng.normal(size=(n, v)).astype(np.float32) * 1.5
    return p, logits


def _softmax(logits: np.ndarray) -> np.ndarray:
    q = np.exp(logits - logits.max(-1, keepdims=True))
    return q / q.sum(-1, keepdims=True)


def test_children_acceptance_matches_the_exact_multi_draft_rates():
    import jax

    v, n = 12, 3
    p, logits = _random_rows(1, v, n)
    q = _softmax(logits)
    ids = np.arange(v)
    trials = 1500
    one = fda.children_acceptance(p, logits, ids, 1, 1.0, jax.random.key(0), trials)
    two = fda.children_acceptance(p, logits, ids, 2, 1.0, jax.random.key(1), trials)
    se = 0.5 / np.sqrt(trials)  # a Bernoulli mean's standard error is at most this
    np.testing.assert_allclose(one, np.minimum(p, q).sum(-1), atol=4 * se)
    np.testing.assert_allclose(two, [_exact_two_children(p[i], q[i]) for i in range(n)],
                               atol=4 * se)
    assert np.all(two > np.minimum(p, q).sum(-1))  # a second child always adds here


def test_children_acceptance_with_q_top_tried_last_matches_its_closed_form():
    """Two children, q's top last (``greedy=1``): the sampled one is drawn from q' = q
    without the top and accepted with sum min(p, q'); the residual then holds all of p's
    mass on the top token (q' is zero there), which the point-mass rule accepts with it:
    p(top) + sum_{y != top} min(p(y), q'(y)) in all."""
    import jax

    v, n = 12, 4
    p, logits = _random_rows(5, v, n)
    # The last row is one where the two rules part: p has 0.8 on q's top (0.4 there), 0.2
    # on one other token, and q spreads the rest evenly.
    p[-1] = np.eye(v)[0] * 0.8 + np.eye(v)[1] * 0.2
    logits[-1] = np.log(np.where(np.arange(v) == 0, 0.4, 0.6 / (v - 1)))
    q = _softmax(logits)
    top = q.argmax(-1)
    q1 = np.where(np.arange(v) == top[:, None], 0.0, q)
    q1 /= q1.sum(-1, keepdims=True)
    exact = p[np.arange(n), top] + np.minimum(p, q1).sum(-1)
    trials = 1500
    got = fda.children_acceptance(p, logits, np.arange(v), 2, 1.0, jax.random.key(6), trials,
                                  greedy=1)
    np.testing.assert_allclose(got, exact, atol=4 * 0.5 / np.sqrt(trials))
    # There two sampled children accept 0.717 and q's top last 0.891: the estimator above
    # would fail had it sampled both.
    assert exact[-1] - _exact_two_children(p[-1], q[-1]) > 0.15


def test_children_acceptance_with_a_lookup_chain_child_matches_its_closed_form():
    """One sampled child x and a lookup chain whose first token is c: where x != c the
    chain is a root child of its own, tried after x with the residual r = norm(max(p - q,
    0)); where x == c it hangs below x and adds nothing at the root. In all: sum min(p, q)
    + r(c) sum_{x != c} max(q(x) - p(x), 0). No chain (-1) is one child alone."""
    import jax

    v, n = 10, 4
    p, logits = _random_rows(7, v, n)
    q = _softmax(logits)
    c = np.array([int(p[0].argmax()), 3, int(q[2].argmax()), -1])
    base = np.minimum(p, q).sum(-1)
    over = np.maximum(q - p, 0)
    resid = np.maximum(p - q, 0) / np.maximum(p - q, 0).sum(-1, keepdims=True)
    exact = base.copy()
    for i in range(3):
        exact[i] += resid[i, c[i]] * (over[i].sum() - over[i, c[i]])
    trials = 1500
    got = fda.children_acceptance(p, logits, np.arange(v), 1, 1.0, jax.random.key(8), trials,
                                  chain_first=c)
    np.testing.assert_allclose(got, exact, atol=4 * 0.5 / np.sqrt(trials))
    # Rows 0 and 1 gain visibly from the chain; row 2's c is q's top, where q > p leaves the
    # residual nothing on it: a chain child there adds nothing.
    assert np.all(exact[:2] - base[:2] > 0.3) and exact[2] == base[2]


def test_children_acceptance_of_a_drafter_equal_to_the_target_is_one():
    import jax

    rng = np.random.default_rng(2)
    logits = rng.normal(size=(2, 9)).astype(np.float32)
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    got = fda.children_acceptance(p, logits, np.arange(9), 1, 1.0, jax.random.key(3), 50)
    np.testing.assert_allclose(got, 1.0)
    # Over a shortlist S (drafts never leave it), one child is accepted with p(S).
    ids = np.array([0, 2, 5, 7])
    got = fda.children_acceptance(p, logits[:, ids], ids, 1, 1.0, jax.random.key(4), 2000)
    np.testing.assert_allclose(got, p[:, ids].sum(-1), atol=4 * 0.5 / np.sqrt(2000))


def _gate_columns():
    """Four positions: no match (the drafter's top-1 stands); a one-token match whose copy
    is wrong; a two-token match whose copy is right, 2 logits under the top-1; a three-token
    match capped at the gate's two, right, 5 under."""
    return {"pair": np.zeros(4, int), "next": np.asarray([1, 2, 3, 4]),
            "top": np.asarray([1, 2, 9, 9]), "l_top": np.asarray([5.0, 5.0, 5.0, 5.0]),
            "copy": np.asarray([0, 8, 3, 4]), "match": np.asarray([0, 1, 2, 3]),
            "l_copy": np.asarray([0.0, 4.0, 3.0, 0.0])}


def test_gated_hits_pick_the_copy_where_its_bonus_beats_the_top():
    g = _gate_columns()
    assert fda.gated_hits(g, ()).tolist() == [True, True, False, False]  # no gate
    assert fda.gated_hits(g, (0.0, 2.5)).tolist() == [True, True, True, False]
    assert fda.gated_hits(g, (0.0, 6.0)).tolist() == [True, True, True, True]
    # A big one-token bonus takes the wrong copy too; a tie keeps the top-1.
    assert fda.gated_hits(g, (2.0, 6.0)).tolist() == [True, False, True, True]
    assert fda.gated_hits(g, (1.0, 6.0)).tolist() == [True, True, True, True]


def test_fit_copy_bias_finds_the_smallest_bonuses_that_take_every_right_copy():
    bias = fda.fit_copy_bias(_gate_columns(), 2)
    assert bias == (0.0, 5.5)
    assert fda.gated_hits(_gate_columns(), bias).all()
    # The m = 1 copy right too: both bonuses must exceed 1 and 2, the m >= 2 copy 5 logits
    # under cannot be taken within `most` = 4; the bonuses never fall with the match.
    g = _gate_columns() | {"next": np.asarray([1, 8, 3, 4])}
    bias = fda.fit_copy_bias(g, 2, most=4.0)
    assert fda.gated_hits(g, bias).tolist() == [True, True, True, False]
    assert 1.0 < bias[0] <= bias[1] <= 4.0


def test_lookups_are_the_lookup_of_each_prefix():
    """Every drafted position's lookup at once equals the lookup of that prefix alone."""
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    ids, lo = rng.integers(0, 5, 30).tolist(), 7
    first, match = fda.lookups(ids, lo, 3)
    assert len(first) == len(match) == len(ids) - 1 - lo
    for k, t in enumerate(range(lo, len(ids) - 1)):
        tok, m = fda.lookup_continuation(jnp.asarray([ids[:t + 1]], jnp.int32),
                                         jnp.asarray([t + 1]), 1, 3)
        assert int(m[0]) == match[k] and (m[0] == 0 or int(tok[0, 0]) == first[k])
    assert match.max() == 3  # the test means something: long matches occur


def test_loop_rate_skips_the_position_after_each_accepted_draft():
    b = lambda *v: np.asarray(v, bool)  # noqa: E731
    # [1, 1, 1, 0, 1]: steps at 0, 2, 4, all accepted; [0, 1, 0, 0]: steps at 0, 1, 3.
    assert fda.loop_rate([b(1, 1, 1, 0, 1)]) == 1.0
    assert fda.loop_rate([b(0, 1, 0, 0)]) == pytest.approx(1 / 3)
    assert fda.loop_rate([b(1, 1, 1, 0, 1), b(0, 1, 0, 0), b()]) == pytest.approx(4 / 6)
    assert fda.pooled([b(1, 1, 1, 0, 1), b(0, 1, 0, 0)]) == pytest.approx(5 / 9)
    assert fda.loop_rate([b(), b()]) is None
    split = fda.by_pair(np.array([True, False, True]), np.array([0, 1, 0]), 2)
    assert [a.tolist() for a in split] == [[True, True], [False]]


def test_loop_rate_of_teacher_forced_hits_is_the_loops_own(tiny_target, fitted_drafter):
    """A greedy chain of depth 1 accepts exactly where the teacher-forced top-1 is right,
    at the positions where its steps start: the replay counts the loop's steps."""
    import specjax

    tree = specjax.TreeSpec("chain", depth=1)
    kinds = set()
    for prompt in ([5, 6, 7], [9, 40, 41, 42, 43], [3, 100, 17, 18]):
        res = specjax.generate(tiny_target, [prompt], max_new_tokens=24, stop_on_eos=False,
                               drafter=fitted_drafter, tree=tree)
        accept = res.stats["accept_lengths"][0]
        hits = fda.agreement(tiny_target, fitted_drafter, [(prompt, res.tokens[0])])
        assert fda.loop_rate(hits) == pytest.approx(sum(a - 1 for a in accept) / len(accept))
        kinds |= set(accept)
    assert kinds == {1, 2}  # the test means something: drafts both accepted and rejected


def _dense_q(ids: np.ndarray, logits: np.ndarray, v: int) -> np.ndarray:
    """[n, v] softmax(logits) scattered onto the vocabulary from ``ids`` (-inf: no mass)."""
    z = np.exp(logits - logits.max(-1, keepdims=True))
    q = np.zeros((logits.shape[0], v))
    for r in range(logits.shape[0]):
        np.add.at(q[r], ids[r] if ids.ndim == 2 else ids, z[r] / z[r].sum())
    return q


def test_gate_logits_give_the_loops_gated_q():
    """The script's gate over a head plus the copies it lacks gives the q that the loop's
    own ``gate_root`` drafts from: a row with no match, a copy the head has (match 2), a
    copy it lacks (match 1: it displaces the lowest head logit), and a match whose bonus
    is 0 (nothing changes)."""
    import jax.numpy as jnp

    from specjax.tree.lookup import gate_root
    from specjax.vocab.head import Candidates

    rng = np.random.default_rng(3)
    v, d = 16, 6
    w = rng.normal(size=(v, d)).astype(np.float32)
    h = rng.normal(size=(4, d)).astype(np.float32)
    head = np.asarray([5, 7, 9, 2])
    copy, match = np.asarray([0, 7, 11, 9]), np.asarray([0, 2, 1, 1])
    bias = (1.5, 2.5)
    cand = np.asarray([5, 7, 9, 2, 11, 0, 0])  # the head, the copy it lacks, padding
    logits = h @ w[cand].T
    for b, want_change in ((bias, [False, True, True, True]),
                           ((0.0, 2.5), [False, True, False, False])):
        got = fda.gate_logits(logits, cand, len(head), copy, match, b)
        assert np.all(np.isneginf(got[:, 5:]))  # padding never drafts
        base = fda.gate_logits(logits, cand, len(head), copy, match, ())
        changed = ~np.all(np.isclose(got, base) | (np.isneginf(got) & np.isneginf(base)),
                          axis=1)
        assert changed.tolist() == want_change
        # The loop: K = 1 root copies over the head, the bonus by the match's length.
        bonus = np.asarray((0.0, *b), np.float32)[np.minimum(match, len(b))]
        loop = gate_root(Candidates(ids=jnp.asarray(np.tile(head, (4, 1, 1)), jnp.int32),
                                    valid=jnp.ones((4, 1, 4), bool),
                                    logits=jnp.asarray((h @ w[head].T)[:, None])),
                         jnp.asarray(h[:, None]), jnp.asarray(w), jnp.asarray(copy, jnp.int32),
                         jnp.asarray(bonus))
        np.testing.assert_allclose(
            _dense_q(cand, got, v),
            _dense_q(np.asarray(loop.ids)[:, 0], np.asarray(loop.logits)[:, 0], v), atol=1e-6)
