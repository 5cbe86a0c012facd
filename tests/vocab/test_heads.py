"""Vocabulary heads: candidate buffers against brute force, budgets, and lossless decoding."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from specjax.speculative import TreeSpec
from specjax.vocab.clusters import Clusters
from specjax.vocab.dynaspec import cluster_budget, routed_head
from specjax.vocab.fr_head import frequency_head, pa_fr_budget
from specjax.vocab.head import full_head
from specjax.vocab.router import Router, RouterConfig, router_logits
from tests.speculative.conftest import PROMPTS

V, D, M = 96, 16, 12


def random_router(in_dim: int, m: int, seed: int = 0):
    return Router(RouterConfig(in_dim=in_dim, num_clusters=m, hidden=32),
                  rngs=nnx.Rngs(seed)).params()


@pytest.fixture(scope="module")
def arrays():
    rs = np.random.RandomState(0)
    w = jnp.asarray(rs.randn(V, D).astype(np.float32))
    h = jnp.asarray(rs.randn(2, 3, D).astype(np.float32))
    ctx = jnp.asarray(rs.randn(2, 3, 2 * D).astype(np.float32))
    assign = rs.randint(0, M, V)
    assign[:M] = np.arange(M)  # every cluster non-empty
    return w, h, ctx, Clusters.from_assign(assign, M)


def test_budgets_follow_the_paper():
    assert [pa_fr_budget(32768, t) for t in range(5)] == [32768, 32768, 10922, 8192, 6553]
    assert [cluster_budget(t, 64, 32) for t in range(5)] == [64, 32, 8, 5, 4]
    assert cluster_budget(40, 64, 32) == 1


def test_frequency_head(arrays):
    w, h, _, _ = arrays
    ranked = np.random.RandomState(1).permutation(V)
    head = frequency_head(w, ranked, always=[5, 7], k_max=40, position_aware=True)
    assert [head.capacity(t) for t in range(4)] == [40, 40, 13, 10]
    for t in range(4):
        c = head(w, h, t)
        ids = np.asarray(c.ids[0, 0])
        assert ids.shape == (head.capacity(t),) and {5, 7} <= set(ids[:2].tolist())
        assert len(set(ids.tolist())) == ids.size and np.asarray(c.valid).all()
        np.testing.assert_allclose(c.logits, jnp.einsum("bkd,cd->bkc", h, w[ids]), rtol=1e-5,
                                   atol=1e-5)
    # Without the always-kept tokens, the list is the ranking's prefix.
    rest = [i for i in ranked.tolist() if i not in (5, 7)]
    assert np.asarray(head.ids[2:]).tolist() == rest[:38]
    with pytest.raises(ValueError, match="exceeds"):
        frequency_head(w, ranked[:10], [5], k_max=20)
    with pytest.raises(ValueError, match="outside"):
        frequency_head(w, np.array([1, 2, V]), [1], k_max=2)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("step", [0, 1, 3])
def test_routed_head_is_the_union_of_the_chosen_clusters(arrays, shared, step):
    w, h, ctx, clusters = arrays
    assign = clusters.assign
    router = random_router(2 * D, M)
    head = routed_head(router, clusters, always=[3, 50], k0=5, k1=3, position_aware=True,
                       shared=shared)
    c = head(w, h, step, ctx)
    k = cluster_budget(step, 5, 3)
    assert c.ids.shape == (2, 3, head.capacity(step))
    assert head.capacity(step) == 2 + sum(sorted(np.bincount(assign), reverse=True)[:k])
    scores = np.asarray(router_logits(router, ctx))
    if shared:
        scores = np.broadcast_to(scores.max(axis=1, keepdims=True), scores.shape)
    for b in range(2):
        for n in range(3):
            chosen = np.argsort(-scores[b, n], kind="stable")[:k]
            want = {3, 50} | set(np.flatnonzero(np.isin(assign, chosen)).tolist())
            ids = np.asarray(c.ids[b, n])[np.asarray(c.valid[b, n])]
            assert len(ids) == len(set(ids.tolist())) and set(ids.tolist()) == want
            assert ids[:2].tolist() == [3, 50]
            logits = np.asarray(c.logits[b, n])
            np.testing.assert_allclose(logits[np.asarray(c.valid[b, n])],
                                       np.asarray(w)[ids] @ np.asarray(h[b, n]), rtol=1e-4,
                                       atol=1e-4)
            assert np.isneginf(logits[~np.asarray(c.valid[b, n])]).all()


def test_routed_head_cap_drops_the_lowest_scored_tail(arrays):
    w, h, ctx, clusters = arrays
    router = random_router(2 * D, M)
    head = routed_head(router, clusters, always=[3], k0=6, cluster_cap=2)
    assert head.capacity(0) == 13 and head.capacity(5) == 13
    c = head(w, h, 0, ctx)
    assert c.ids.shape[-1] == 13 and np.asarray(c.valid[..., 0]).all()
    # The kept part is the start of the uncapped buffer (best-scored clusters first).
    full = routed_head(router, clusters, always=[3], k0=6)(w, h, 0, ctx)
    np.testing.assert_array_equal(c.ids, full.ids[..., :13])


def test_full_head_matches_the_lm_head(arrays):
    w, h, _, _ = arrays
    c = full_head(V)(w, h, 2)
    # 1..16 rows take the CPU rowdot kernel, whose summation order differs from XLA's.
    np.testing.assert_allclose(c.logits, jnp.einsum("bkd,vd->bkv", h, w), rtol=1e-5, atol=1e-6)
    assert np.asarray(c.ids[1, 2]).tolist() == list(range(V))


# --- lossless decoding with every head (the target verifies over the full vocabulary) ---


def example_heads(w, fr_rows: int) -> dict:
    """One seeded head of each kind over the LM head ``w`` [V, d] (FR with ``fr_rows``
    rows), random frequencies, clusters and router: what the lossless tests here and
    tests/spmd decode with."""
    v, d = w.shape
    rs = np.random.RandomState(3)
    ranked = rs.permutation(v)
    clusters = Clusters.from_assign(rs.randint(0, 8, v), 8)
    router = random_router(2 * d, 8)
    return {
        "fr": frequency_head(w, ranked, [0], k_max=fr_rows),
        "pafr": frequency_head(w, ranked, [0], k_max=v // 2, position_aware=True),
        "dynaspec-f": routed_head(router, clusters, [0], k0=3),
        "dynaspec-pa": routed_head(router, clusters, [0], k0=4, k1=2, position_aware=True),
        "dynaspec-shared": routed_head(router, clusters, [0], k0=4, k1=2, position_aware=True,
                                       shared=True),
    }


@pytest.fixture(scope="module")
def heads(tiny_target):
    w = tiny_target.params.head
    return example_heads(w, fr_rows=w.shape[0] // 3)


@pytest.mark.parametrize("name", ["fr", "pafr", "dynaspec-f", "dynaspec-pa", "dynaspec-shared"])
def test_greedy_equals_vanilla_for_every_head(tiny_target, fitted_drafter, heads, name):
    vanilla = specjax.generate(tiny_target, PROMPTS, max_new_tokens=24,
                               stop_on_eos=False).tokens
    res = specjax.generate(tiny_target, PROMPTS, max_new_tokens=24, stop_on_eos=False,
                           drafter=fitted_drafter, vocab=heads[name],
                           tree=TreeSpec("eagle2", depth=4, top_k=3, total_tokens=10))
    assert res.tokens == vanilla
    s = res.stats
    assert s["vocab"] == heads[name].name
    assert 0 < s["mean_shortlist_size"] < tiny_target.cfg.vocab_size
    assert 0.0 <= s["shortlist_coverage"] <= 1.0


def test_sampled_drafts_from_a_shortlist_keep_the_output_valid(tiny_target, fitted_drafter,
                                                               heads):
    res = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, temperature=0.8, seed=1,
                           stop_on_eos=False, drafter=fitted_drafter, vocab=heads["pafr"],
                           tree=TreeSpec("chain", depth=3))
    assert all(len(t) == 16 for t in res.tokens)
    assert all(0 <= i < tiny_target.cfg.vocab_size for t in res.tokens for i in t)
