"""Draft trees: layout invariants, builders against numpy brute force, stochastic drafting.

The drafter is synthetic: it keeps a workspace of node tokens (written at ``node_idx``), and
a node's candidate logits are a row of a fixed random table chosen by (sum of the tokens on
its path, its depth). The path sum goes through the ``ancestors`` rows the builder passes,
so the tests also check the ExpandFn protocol: a wrong row, index or position changes
the logits and the brute-force comparison fails.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from jax import Array

from specjax.tree import (
    DraftTree,
    build_chain,
    build_eagle2,
    build_static,
    eagle2_sizes,
    normalize_paths,
    pack_ancestors,
    tree_positions,
    unpack_ancestors,
)

R = 23  # rows of the logit table
C = 10  # candidates per expansion
V_SHORT = 16  # vocabulary of the shortlist variant (C of its ids are candidates)
B = 3

SETTINGS = settings(max_examples=12, deadline=None, database=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------------------
# The synthetic drafter and its numpy twin
# --------------------------------------------------------------------------------------


def make_expand(table: jax.Array, ids: jax.Array, shapes: list | None = None):
    """ExpandFn whose logits are ``table[(7 * path_sum + 3 * depth) % R]`` over ``ids``."""

    def expand(carry, tokens, positions, node_idx, ancestors, step):
        ws, calls = carry
        if shapes is not None:
            shapes.append((tokens.shape, ancestors.shape))
        ws = ws.at[jnp.arange(ws.shape[0])[:, None], node_idx].set(tokens)
        path_sum = jnp.einsum("bkn,bn->bk", ancestors.astype(jnp.int32), ws)
        logits = table[(7 * path_sum + 3 * positions) % R]
        return (ws, calls + 1), jnp.broadcast_to(ids, logits.shape), logits

    return expand


def ref_logits(table: np.ndarray, path: tuple[int, ...]) -> np.ndarray:
    """Candidate logits (float64) after the token path root .. node."""
    return table[(7 * sum(path) + 3 * (len(path) - 1)) % R].astype(np.float64)


def log_softmax(x: np.ndarray) -> np.ndarray:
    fin = np.isfinite(x)
    if not fin.any():
        return np.full_like(x, -np.inf)
    m = x[fin].max()
    lse = m + np.log(np.exp(x[fin] - m).sum())
    return np.where(fin, x - lse, -np.inf)


def topk_order(x: np.ndarray) -> np.ndarray:
    """Candidate positions by descending logit, the lower index first on ties."""
    return np.argsort(-x, kind="stable")


def random_table(seed: int, inf_frac: float = 0.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(R, C)).astype(np.float32)
    table[rng.random((R, C)) < inf_frac] = -np.inf
    if inf_frac:
        table[rng.integers(R)] = -np.inf  # a node with no valid candidate at all
    return table


def shortlist_ids(seed: int, shortlist: bool) -> np.ndarray:
    if not shortlist:
        return np.arange(C, dtype=np.int32)
    return np.random.default_rng(seed + 1).permutation(V_SHORT)[:C].astype(np.int32)


def workspace(builder: str, static: dict) -> int:
    if builder == "chain":
        return static["depth"] + 1
    if builder == "static":
        return len(static["paths"]) + 1
    return eagle2_sizes(static["top_k"], static["depth"])[0]


BUILDERS = {"chain": build_chain, "static": build_static, "eagle2": build_eagle2}
N_SAMPLES = 5000  # rows of the sampled chain and static runs: one call, a chi-square sample


def build(builder: str, table, ids, root, *, key=None, temperature=0.0, vocab_size=None,
          shapes=None, **static) -> tuple[DraftTree, Array]:
    """A builder on the synthetic drafter; returns the tree and the number of expand calls."""
    root = jnp.asarray(root, jnp.int32)
    carry = (jnp.zeros((root.shape[0], workspace(builder, static)), jnp.int32), jnp.int32(0))
    tree, (_, calls) = BUILDERS[builder](
        make_expand(jnp.asarray(table), jnp.asarray(ids), shapes), carry, root, key=key,
        temperature=temperature, vocab_size=vocab_size, **static)
    return tree, calls


def trace(builder: str, *args, **kw):
    """Trace only (no compile): for shapes, call structure and trace-time errors."""
    return jax.eval_shape(lambda: build(builder, *args, **kw))


@functools.cache
def compiled(builder: str, static_items: tuple, sampled: bool):
    """One compiled builder per configuration; tables, roots, keys are arguments."""
    static = dict(static_items)

    @jax.jit
    def run(table, ids, root, key, temperature):
        return build(builder, table, ids, root, key=key if sampled else None,
                     temperature=temperature if sampled else 0.0,
                     vocab_size=V_SHORT if sampled else None, **static)

    return run


def run(builder: str, table, ids, root, *, seed: int | None = None, temperature=1.0,
        **static) -> tuple[DraftTree, Array]:
    """Compiled builder; sampled (vocabulary V_SHORT, per-row temperature) iff ``seed``.

    Tests use "rbg" keys: they compile much faster than threefry on CPU, and the builders
    only split, fold and draw Gumbel noise, whatever the key's implementation.
    """
    root = np.asarray(root, np.int32)
    key = jax.random.key(0 if seed is None else seed, impl="rbg")
    temp = np.broadcast_to(np.asarray(temperature, np.float32), root.shape)
    return compiled(builder, tuple(static.items()), seed is not None)(
        np.asarray(table), np.asarray(ids), root, key, temp)


def head(tree: DraftTree, n: int = B) -> DraftTree:
    """The first n rows of a tree (the invariant checks loop over rows in Python)."""
    return jax.tree.map(lambda x: x[:n], tree)


# --------------------------------------------------------------------------------------
# Invariants
# --------------------------------------------------------------------------------------


def check_invariants(tree: DraftTree) -> None:
    """The layout every builder promises, checked in numpy."""
    tok, par, dep, val = (np.asarray(x) for x in (tree.tokens, tree.parent, tree.depth,
                                                  tree.valid))
    anc, logp, score = (np.asarray(x) for x in (tree.ancestors, tree.draft_logp, tree.score))
    b, t = tok.shape
    assert tok.dtype == par.dtype == dep.dtype == np.int32 and val.dtype == bool
    assert anc.shape == (b, t, t) and anc.dtype == bool
    assert logp.dtype == score.dtype == np.float32
    assert (par[:, 0] == -1).all() and (dep[:, 0] == 0).all() and val[:, 0].all()
    assert (logp[:, 0] == 0).all() and (score[:, 0] == 0).all()
    for r in range(b):
        closure = np.eye(t, dtype=bool)
        for i in range(1, t):
            p = par[r, i]
            assert 0 <= p < i, "parents come before children"
            assert dep[r, i] == dep[r, p] + 1
            closure[i] |= closure[p]
            if val[r, i]:
                assert val[r, p], "a valid node's parent is valid"
                assert np.isfinite(logp[r, i]) and logp[r, i] <= 0
                np.testing.assert_allclose(score[r, i], score[r, p] + logp[r, i], rtol=1e-5,
                                           atol=1e-5)
            else:
                assert (tok[r, i], p, dep[r, i]) == (0, 0, 1), "canonical padding"
                assert logp[r, i] == score[r, i] == -np.inf
        np.testing.assert_array_equal(anc[r], closure)
        assert not anc[r][val[r]][:, ~val[r]].any(), "padding hidden from valid nodes"
        # Breadth-first layout: valid nodes by (depth, parent index).
        keys = list(zip(dep[r][val[r]], par[r][val[r]], strict=True))
        assert keys == sorted(keys)
        for p in np.unique(par[r][val[r]]):
            kids = np.flatnonzero(val[r] & (par[r] == p))
            assert len(set(tok[r, kids])) == len(kids), "siblings are distinct tokens"
            if not tree.sampled:  # drafted order = top-k order
                assert (np.diff(logp[r, kids]) <= 0).all()
    # Packed bitmask: bit j % 32 of word j // 32, and the round trip.
    packed = np.asarray(tree.packed_ancestors())
    assert packed.shape == (b, t, math.ceil(t / 32)) and packed.dtype == np.uint32
    j = np.arange(t)
    np.testing.assert_array_equal((packed[..., j // 32] >> (j % 32)) & 1, anc)
    np.testing.assert_array_equal(np.asarray(unpack_ancestors(tree.packed_ancestors(), t)), anc)
    if not tree.sampled:
        assert tree.draft_dist is None
        return
    dist = np.asarray(tree.draft_dist)
    sums = dist.sum(-1)
    assert np.all((np.abs(sums - 1) < 1e-5) | (sums == 0))
    fixed = np.zeros_like(val) if tree.fixed is None else np.asarray(tree.fixed)
    for r in range(b):
        for i in np.flatnonzero(val[r])[1:]:
            p = par[r, i]
            assert abs(sums[r, p] - 1) < 1e-5, "an expanded node's q sums to 1"
            if fixed[r, i]:  # q's top child (greedy multi-draft): never in the sampled law
                assert dist[r, p, tok[r, i]] == 0
                continue
            np.testing.assert_allclose(np.log(dist[r, p, tok[r, i]]), logp[r, i], rtol=1e-5,
                                       atol=1e-5)


def token_paths(tree: DraftTree, r: int) -> dict[tuple[int, ...], int]:
    """Valid node index by its token path from the root."""
    tok, par, val = (np.asarray(x)[r] for x in (tree.tokens, tree.parent, tree.valid))
    paths = {0: (int(tok[0]),)}
    for i in range(1, len(tok)):
        if val[i]:
            paths[i] = paths[int(par[i])] + (int(tok[i]),)
    return {p: i for i, p in paths.items()}


@st.composite
def path_lists(draw, max_nodes: int = 12, max_depth: int = 3, max_children: int = 3):
    """A random prefix-closed, rank-contiguous path list, in random order."""
    paths, frontier = [], [()]
    while frontier and len(paths) < max_nodes:
        p = frontier.pop(0)
        if len(p) >= max_depth:
            continue
        for rank in range(draw(st.integers(0 if p else 1, max_children))):
            paths.append(p + (rank,))
            frontier.append(p + (rank,))
    return tuple(draw(st.permutations(paths)))


def ref_static(table, ids, root: int, paths) -> tuple[np.ndarray, ...]:
    """tokens, valid, draft_logp, score of a static tree, node by node in numpy."""
    norm = normalize_paths(paths)
    info = {(): ((root,), True, 0.0, 0.0)}
    for p in norm:
        toks, ok, _, score = info[p[:-1]]
        lq = log_softmax(ref_logits(table, toks))
        j = topk_order(lq)[p[-1]]
        ok = ok and bool(np.isfinite(lq[j]))
        info[p] = (toks + (int(ids[j]),), ok, lq[j] if ok else -np.inf,
                   score + lq[j] if ok else -np.inf)
    nodes = [info[()]] + [info[p] for p in norm]
    return (np.array([n[0][-1] if n[1] else 0 for n in nodes]), np.array([n[1] for n in nodes]),
            np.array([n[2] for n in nodes]), np.array([n[3] for n in nodes]))


def ref_eagle2(table, ids, root: int, top_k: int, depth: int, total: int):
    """EAGLE-2 in plain Python: {token path: cumulative log q} of the selected nodes, and
    the smallest gap between kept and dropped values (float32 vs float64 near-ties)."""
    def children(path, score):
        lq = log_softmax(ref_logits(table, path))
        return [(path + (int(ids[j]),), score + lq[j]) for j in topk_order(lq)[:top_k]]

    def best(nodes, n):  # stable: the lower index first on ties
        order = sorted(range(len(nodes)), key=lambda i: -nodes[i][1])
        vals = [nodes[i][1] for i in order]
        gap = vals[n - 1] - vals[n] if n < len(vals) else np.inf
        return sorted(order[:n]), gap

    pool = beam = children((root,), 0.0)
    gaps = []
    for _ in range(depth - 1):
        level = [c for node in beam for c in children(*node)]
        pool = pool + level
        keep, gap = best(level, top_k)
        beam, gaps = [level[i] for i in keep], gaps + [gap]
    keep, gap = best(pool, total)
    return {pool[i][0]: pool[i][1] for i in keep}, min(gaps + [gap])


def first_two_draw_dists(table, root: int) -> tuple[np.ndarray, np.ndarray]:
    """q at the root, and the law of the second draw without replacement."""
    q = np.exp(log_softmax(ref_logits(table, (root,)) / TEMP))
    second = np.array([sum(q[x] * q[y] / (1 - q[x]) for x in range(C) if x != y)
                       for y in range(C)])
    return q, second


def chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=C)
    return scipy.stats.chisquare(counts, probs * len(samples)).pvalue


seeds = st.integers(0, 2**31 - 1)
inf_fracs = st.sampled_from([0.0, 0.3, 0.7])
TEMP = 1.3
MEDUSA_LIKE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (2, 0), (0, 2))


def random_roots(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, C, n)


# --------------------------------------------------------------------------------------
# Chain
# --------------------------------------------------------------------------------------


def ref_chain(table, ids, root: int, depth: int) -> tuple[tuple[int, ...], list[float]]:
    """Repeated argmax until depth or a node without a valid candidate."""
    path, logp = (root,), [0.0]
    for _ in range(depth):
        lq = log_softmax(ref_logits(table, path))
        j = topk_order(lq)[0]
        if not np.isfinite(lq[j]):
            break
        path, logp = path + (int(ids[j]),), logp + [lq[j]]
    return path, logp


@SETTINGS
@given(seed=seeds, inf_frac=inf_fracs, shortlist=st.booleans(), sampled=st.booleans())
def test_chain(seed, inf_frac, shortlist, sampled):
    table, ids = random_table(seed, inf_frac), shortlist_ids(seed, shortlist)
    roots = random_roots(seed, N_SAMPLES if sampled else B)
    tree, calls = run("chain", table, ids, roots, seed=seed if sampled else None,
                      temperature=0.7, depth=5)
    assert int(calls) == 5 and tree.sampled == sampled and tree.num_nodes == 6
    tree = head(tree)
    check_invariants(tree)
    val = np.asarray(tree.valid)
    assert (np.asarray(tree.depth)[val] == np.nonzero(val)[1]).all()
    if sampled:
        return
    for r in range(B):  # greedy = repeated argmax
        path, logp = ref_chain(table, ids, int(roots[r]), 5)
        n = len(path)
        np.testing.assert_array_equal(np.asarray(tree.tokens[r, :n]), path)
        assert val[r, :n].all() and not val[r, n:].any()
        np.testing.assert_allclose(np.asarray(tree.draft_logp[r, :n]), logp, atol=1e-5)
        np.testing.assert_allclose(np.asarray(tree.score[r, :n]), np.cumsum(logp), atol=1e-5)


def test_tree_positions_and_pytree():
    table, ids = random_table(0), shortlist_ids(0, False)
    tree, _ = run("chain", table, ids, [1, 2, 3], depth=5)
    pos = tree_positions(tree, jnp.array([5, 9, 0]))
    np.testing.assert_array_equal(np.asarray(pos[:2]), [np.arange(5, 11), np.arange(9, 15)])
    assert len(jax.tree_util.tree_leaves(tree)) == 7  # draft_dist None; sampled is static
    sampled, _ = run("chain", table, ids, random_roots(0, N_SAMPLES), seed=0, depth=5)
    leaves, treedef = jax.tree_util.tree_flatten(sampled)
    assert len(leaves) == 8
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert again.sampled and again.draft_dist.shape == (N_SAMPLES, 6, V_SHORT)
    # Default (threefry) keys trace too; a key with temperature 0 still drafts greedily.
    out, _ = trace("eagle2", table, ids, [1, 2], key=jax.random.key(0), temperature=1.0,
                   top_k=3, depth=3, total_tokens=8)
    assert out.sampled and out.draft_dist.shape == (2, 9, C)
    out, _ = trace("chain", table, ids, [1], key=jax.random.key(1), temperature=0.0, depth=3)
    assert not out.sampled and out.draft_dist is None


def test_pack_unpack_round_trip():
    rng = np.random.default_rng(0)
    for t in (1, 33, 70):
        anc = rng.random((2, t, t)) < 0.4
        packed = pack_ancestors(jnp.asarray(anc))
        assert packed.shape == (2, t, math.ceil(t / 32)) and packed.dtype == jnp.uint32
        np.testing.assert_array_equal(np.asarray(unpack_ancestors(packed, t)), anc)


# --------------------------------------------------------------------------------------
# Static trees
# --------------------------------------------------------------------------------------


def check_static_brute_force(tree: DraftTree, table, ids, roots, paths) -> None:
    for r in range(tree.tokens.shape[0]):
        tok, val, logp, score = ref_static(table, ids, int(roots[r]), paths)
        np.testing.assert_array_equal(np.asarray(tree.tokens[r]), tok)
        np.testing.assert_array_equal(np.asarray(tree.valid[r]), val)
        np.testing.assert_allclose(np.asarray(tree.draft_logp[r]), logp, atol=1e-5)
        np.testing.assert_allclose(np.asarray(tree.score[r]), score, atol=1e-5)


@SETTINGS
@given(seed=seeds, inf_frac=inf_fracs, sampled=st.booleans())
def test_static(seed, inf_frac, sampled):
    table, ids = random_table(seed, inf_frac), shortlist_ids(seed, True)
    roots = random_roots(seed, N_SAMPLES if sampled else B)
    tree, calls = run("static", table, ids, roots, seed=seed if sampled else None,
                      temperature=TEMP, paths=MEDUSA_LIKE)
    assert int(calls) == 3 and tree.num_nodes == len(MEDUSA_LIKE) + 1
    tree = head(tree)
    check_invariants(tree)
    if not sampled:
        check_static_brute_force(tree, table, ids, roots, MEDUSA_LIKE)


@settings(SETTINGS, max_examples=4)
@given(paths=path_lists(), seed=seeds, inf_frac=inf_fracs, sampled=st.booleans())
def test_static_random_paths(paths, seed, inf_frac, sampled):
    table, ids = random_table(seed, inf_frac), shortlist_ids(seed, False)
    roots = random_roots(seed, B)
    norm = normalize_paths(paths)
    levels = max(map(len, paths))
    # One expand call per level, K = the most nodes with children on any level.
    shapes = []
    trace("static", table, ids, roots, shapes=shapes, paths=paths)
    k = max(len({p[:-1] for p in norm if len(p) == d + 1}) for d in range(levels))
    assert shapes == [((B, k), (B, k, len(paths) + 1))] * levels
    tree, calls = run("static", table, ids, roots, seed=seed if sampled else None,
                      temperature=TEMP, paths=paths)
    assert int(calls) == levels
    check_invariants(tree)
    val = np.asarray(tree.valid)
    depth_s = np.broadcast_to(np.array([0] + [len(p) for p in norm]), val.shape)
    assert (np.asarray(tree.depth)[val] == depth_s[val]).all()
    if not sampled:
        check_static_brute_force(tree, table, ids, roots, paths)


# --------------------------------------------------------------------------------------
# EAGLE-2
# --------------------------------------------------------------------------------------


@SETTINGS
@given(seed=seeds, inf_frac=inf_fracs, shortlist=st.booleans(), sampled=st.booleans())
def test_eagle2(seed, inf_frac, shortlist, sampled):
    table, ids = random_table(seed, inf_frac), shortlist_ids(seed, shortlist)
    roots = random_roots(seed, B)
    tree, calls = run("eagle2", table, ids, roots, seed=seed if sampled else None,
                      temperature=0.8, top_k=3, depth=3, total_tokens=8)
    assert int(calls) == 3 and tree.num_nodes == 9 and tree.sampled == sampled
    check_invariants(tree)
    if inf_frac == 0:
        assert np.asarray(tree.valid).all()
    if sampled or inf_frac:
        return
    # The top total_tokens of the beam-search pool, as plain-Python EAGLE-2 finds them.
    refs = [ref_eagle2(table, ids, int(x), 3, 3, 8) for x in roots[:B]]
    assume(min(gap for _, gap in refs) > 1e-4)  # float32 vs float64 near-ties
    for r, (want, _) in enumerate(refs):
        got = token_paths(tree, r)
        assert set(got) - {(int(roots[r]),)} == set(want)
        for path, score in want.items():
            np.testing.assert_allclose(float(tree.score[r, got[path]]), score, atol=1e-5)


def test_eagle2_larger_tree():
    """T = 41 > 32 (two mask words); the call structure seen by the drafter."""
    table, ids = random_table(11), shortlist_ids(11, True)
    roots = np.array([2, 5, 8])
    shapes = []
    trace("eagle2", table, ids, roots, shapes=shapes, top_k=4, depth=4, total_tokens=40)
    ws = eagle2_sizes(4, 4)[0]
    assert ws == 13  # the root, then a beam of top_k per call but the last
    # The root alone, then the beam once per level (unrolled).
    assert shapes == [((3, 1), (3, 1, ws))] + [((3, 4), (3, 4, ws))] * 3
    tree, calls = run("eagle2", table, ids, roots, top_k=4, depth=4, total_tokens=40)
    assert tree.num_nodes == 41 and int(calls) == 4
    check_invariants(tree)
    assert np.asarray(tree.valid).all() and np.asarray(tree.depth).max() == 4
    for r in range(3):
        want, gap = ref_eagle2(table, ids, int(roots[r]), 4, 4, 40)
        assert gap > 1e-4
        assert set(token_paths(tree, r)) - {(int(roots[r]),)} == set(want)


def test_eagle2_depth_one_is_top_k_of_root():
    table, ids = random_table(2), shortlist_ids(2, False)
    tree, calls = run("eagle2", table, ids, [4, 4, 4], top_k=5, depth=1, total_tokens=3)
    lq = log_softmax(ref_logits(table, (4,)))
    np.testing.assert_array_equal(np.asarray(tree.tokens[0]), [4, *ids[topk_order(lq)[:3]]])
    assert int(calls) == 1 and (np.asarray(tree.parent[0]) == [-1, 0, 0, 0]).all()


def test_eagle2_ties():
    """Exact ties: the selection stays ancestor-closed, siblings prefix-closed."""
    ids = np.arange(C, dtype=np.int32)
    peaked = np.zeros((R, C), np.float32)
    peaked[:, 0] = 50.0  # log q(first) == 0: a first child ties with its parent
    tree, _ = run("eagle2", peaked, ids, [1, 3, 5], top_k=3, depth=3, total_tokens=8)
    check_invariants(tree)
    # Uniform q: equal values everywhere on a level; the lower pool index wins.
    flat, _ = run("eagle2", np.zeros((R, C), np.float32), ids, [1, 3, 5], top_k=3, depth=3,
                  total_tokens=8)
    check_invariants(flat)
    # Level-1 values (log 0.1) beat level-2 ones (2 log 0.1): all three come first, then
    # the level-2 nodes of the lowest pool indices: the first parent's children first.
    np.testing.assert_array_equal(np.asarray(flat.depth[0]), [0, 1, 1, 1, 2, 2, 2, 2, 2])
    np.testing.assert_array_equal(np.asarray(flat.parent[0]), [-1, 0, 0, 0, 1, 1, 1, 2, 2])


# --------------------------------------------------------------------------------------
# Stochastic drafting
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sampling_table() -> np.ndarray:
    # Moderately peaked, so q and the second-draw law differ clearly (the test has power).
    return (1.5 * np.random.default_rng(7).normal(size=(R, C))).astype(np.float32)


def test_sampled_children_follow_q(sampling_table):
    """5k rows in one call each: node 1 (the root's first sampled child) ~ q, node 2 of
    the static tree ~ the second draw without replacement."""
    ids = np.arange(C, dtype=np.int32)
    roots = np.full(N_SAMPLES, 3)
    q, second = first_two_draw_dists(sampling_table, 3)
    chain, _ = run("chain", sampling_table, ids, roots, seed=1, temperature=TEMP, depth=5)
    assert chi2_pvalue(np.asarray(chain.tokens[:, 1]), q) > 1e-3
    static, _ = run("static", sampling_table, ids, roots, seed=2, temperature=TEMP,
                    paths=MEDUSA_LIKE)
    first, nxt = np.asarray(static.tokens[:, 1]), np.asarray(static.tokens[:, 2])
    assert (first != nxt).all()
    assert chi2_pvalue(first, q) > 1e-3
    assert chi2_pvalue(nxt, second) > 1e-3
    assert chi2_pvalue(nxt, q) < 1e-6  # power: the test tells the two laws apart
    # EAGLE-2 keeps a prefix of each node's sampling order: with one node kept out of
    # top_k=3 root draws (and 9 grandchildren), it is the root's first draw, ~ q. Keeping
    # the sampled children of largest log q instead would bias it to likely tokens.
    eagle, _ = run("eagle2", sampling_table, ids, roots, seed=3, temperature=TEMP, top_k=3,
                   depth=2, total_tokens=1)
    assert (np.asarray(eagle.parent[:, 1]) == 0).all()
    assert chi2_pvalue(np.asarray(eagle.tokens[:, 1]), q) > 1e-3
    for tree in (chain, static, eagle):
        np.testing.assert_allclose(np.asarray(tree.draft_dist[0, 0, :C]), q, rtol=1e-4)
        assert (np.asarray(tree.draft_dist[:, :, C:]) == 0).all()


def test_per_row_temperature(sampling_table):
    """A [B] temperature array samples each row at its own temperature."""
    ids = np.arange(C, dtype=np.int32)
    temps = np.where(np.arange(N_SAMPLES) < N_SAMPLES // 2, 0.5, 2.0).astype(np.float32)
    tree, _ = run("chain", sampling_table, ids, np.full(N_SAMPLES, 3), seed=4,
                  temperature=temps, depth=5)
    for r in (0, N_SAMPLES - 1):
        q = np.exp(log_softmax(ref_logits(sampling_table, (3,)) / temps[r]))
        np.testing.assert_allclose(np.asarray(tree.draft_dist[r, 0, :C]), q, rtol=1e-4)


# --------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("paths, match", [
    ((), "at least one"),
    (((),), "empty path"),
    (((1,),), "contiguous"),
    (((0,), (0, 1)), "contiguous"),
    (((0,), (2,), (1,), (0, 0), (1, 1)), "contiguous"),
    (((0, 0),), "prefix-closed"),
    (((0,), (0,)), "twice"),
    (((-1,),), "negative"),
    ((("a",),), "ints"),
])
def test_invalid_static_paths(paths, match):
    with pytest.raises(ValueError, match=match):
        normalize_paths(paths)
    with pytest.raises(ValueError, match=match):
        trace("static", random_table(0), np.arange(C), [1], paths=paths)


def test_normalize_paths_sorts_breadth_first():
    assert normalize_paths([[1], [0, 0], [0]]) == ((0,), (1,), (0, 0))


def test_threshold_only_where_a_builder_reads_it():
    from specjax.tree import TreeSpec

    for kind, fields in (("chain", {"depth": 2}), ("static", {"paths": ((0,),)}),
                         ("eagle2", {}), ("dyspec", {})):
        with pytest.raises(ValueError, match="only dyspec-threshold trees take a threshold"):
            TreeSpec(kind, threshold=0.1, **fields)
        TreeSpec(kind, **fields)  # the default 0 is every kind's


def test_bad_sizes_and_modes():
    table, ids = random_table(0), np.arange(C)
    with pytest.raises(ValueError, match="exceeds"):
        trace("eagle2", table, ids, [1], top_k=3, depth=2, total_tokens=13)  # pool = 12
    with pytest.raises(ValueError, match="C=10"):
        trace("eagle2", table, ids, [1], top_k=11, depth=2, total_tokens=5)
    with pytest.raises(ValueError, match="C=10"):
        trace("static", table, ids, [1], paths=tuple((r,) for r in range(11)))
    with pytest.raises(ValueError, match=">= 1"):
        trace("chain", table, ids, [1], depth=0)
    with pytest.raises(ValueError, match=">= 1"):
        trace("eagle2", table, ids, [1], top_k=0, depth=2, total_tokens=1)
    with pytest.raises(ValueError, match="key"):
        trace("chain", table, ids, [1], depth=2, temperature=0.5)
    with pytest.raises(ValueError, match=">= 0"):
        trace("chain", table, ids, [1], depth=2, key=jax.random.key(0), temperature=-1.0)
