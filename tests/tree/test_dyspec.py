"""DySpec's greedy and threshold trees, and the node orders (BFS / DFS), on the synthetic
drafter of test_tree.py: brute-force optimality, the layout invariants, sampled children."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from hypothesis import given
from hypothesis import strategies as st

from specjax.tree import (
    TreeSpec,
    bfs_order,
    build_dyspec,
    build_dyspec_threshold,
    dfs_order,
    mask_blocks,
    permute_nodes,
)
from tests.tree.test_tree import (
    N_SAMPLES,
    SETTINGS,
    TEMP,
    V_SHORT,
    B,
    C,
    check_invariants,
    chi2_pvalue,
    first_two_draw_dists,
    head,
    log_softmax,
    make_expand,
    random_roots,
    random_table,
    ref_logits,
    shortlist_ids,
    token_paths,
    topk_order,
)

FNS = {"dyspec": build_dyspec, "dyspec-threshold": build_dyspec_threshold}


@functools.cache
def compiled(kind: str, static_items: tuple, sampled: bool):
    static = dict(static_items)

    @jax.jit
    def go(table, ids, root, key, temperature):
        carry = (jnp.zeros((root.shape[0], static["total_tokens"] + 1), jnp.int32),
                 jnp.int32(0))
        tree, (_, calls) = FNS[kind](make_expand(table, ids), carry, root,
                                     key=key if sampled else None,
                                     temperature=temperature if sampled else 0.0,
                                     vocab_size=V_SHORT if sampled else None, **static)
        return tree, calls

    return go


def run(kind: str, table, ids, roots, *, seed: int | None = None, temperature=1.0, **static):
    roots = np.asarray(roots, np.int32)
    key = jax.random.key(0 if seed is None else seed, impl="rbg")
    temp = np.broadcast_to(np.asarray(temperature, np.float32), roots.shape)
    return compiled(kind, tuple(static.items()), seed is not None)(
        np.asarray(table), np.asarray(ids), roots, key, temp)


# --------------------------------------------------------------------------------------
# The objective, by brute force
# --------------------------------------------------------------------------------------


def children(table, ids, path: tuple[int, ...]) -> list[tuple[int, float]]:
    """(token, log q) of a node's valid candidates in drafted (top-k) order."""
    lq = log_softmax(ref_logits(table, path))
    return [(int(ids[j]), float(lq[j])) for j in topk_order(lq) if np.isfinite(lq[j])]


def path_prob(table, ids, path: tuple[int, ...]) -> float:
    """Product of q along a token path (the root's path is 1)."""
    logp = 0.0
    for i in range(1, len(path)):
        logp += dict(children(table, ids, path[:i]))[path[i]]
    return float(np.exp(logp))


def slot_value(table, ids, path, k: int, value: str = "accept") -> float:
    """Value of the k-th child slot of the node at token ``path``: P(path) * q(k-th child)
    ("accept"), or P(path) * (1 - prior q) ("reach", the paper's)."""
    kids = children(table, ids, path)
    if value == "accept":
        return path_prob(table, ids, path) * float(np.exp(kids[k][1]))
    return path_prob(table, ids, path) * (1.0 - sum(np.exp(lq) for _, lq in kids[:k]))


def open_slots(table, ids, nodes: frozenset[tuple[int, ...]]):
    """Every (path, k, child path) that could be added to a tree of token paths."""
    for path in nodes:
        kids = children(table, ids, path)
        k = sum(1 for tok, _ in kids if path + (tok,) in nodes)
        if k < len(kids):
            yield path, k, path + (kids[k][0],)


def objective(table, ids, nodes: frozenset, value: str = "accept") -> float:
    """The sum of the slot values the tree's nodes filled ("accept": the estimated accepted
    length)."""
    total = 0.0
    for node in nodes:
        if len(node) > 1:
            parent = node[:-1]
            k = [tok for tok, _ in children(table, ids, parent)].index(node[-1])
            total += slot_value(table, ids, parent, k, value)
    return total


def best_tree_value(table, ids, root: int, n: int, value: str = "accept") -> float:
    """Max objective over every tree of n drafted nodes (siblings a prefix of top-k order)."""
    trees = {frozenset({(root,)})}
    for _ in range(n):
        trees = {t | {child} for t in trees for _, _, child in open_slots(table, ids, t)} or trees
    return max(objective(table, ids, t, value) for t in trees)


@pytest.mark.parametrize("seed,inf_frac,n,value", list(itertools.product(
    [0, 1, 2], [0.0, 0.5], [3, 5], ["accept", "reach"])))
def test_greedy_is_optimal(seed, inf_frac, n, value):
    """Algorithm 1 maximises the sum of its slot values (appendix D), checked against every
    tree of the same size: the estimated accepted length ("accept", the deterministic
    default) and the paper's reach values."""
    table, ids = random_table(seed, inf_frac), shortlist_ids(seed, False)
    roots = random_roots(seed, B)
    tree, calls = run("dyspec", table, ids, roots, total_tokens=n, value=value)
    assert int(calls) == n  # the root and every drafted node but the last
    tree = head(tree)
    check_invariants(tree)
    for r in range(B):
        nodes = frozenset(token_paths(tree, r))
        got = objective(table, ids, nodes, value)
        np.testing.assert_allclose(got, best_tree_value(table, ids, int(roots[r]), n, value),
                                   rtol=1e-5, atol=1e-6)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), inf_frac=st.sampled_from([0.0, 0.3]),
       shortlist=st.booleans(), sampled=st.booleans())
def test_layouts(seed, inf_frac, shortlist, sampled):
    """Both builders keep every layout invariant, deterministic and sampled, full vocabulary
    or a shortlist."""
    table, ids = random_table(seed, inf_frac), shortlist_ids(seed, shortlist)
    roots = random_roots(seed, B)
    for kind, static in (("dyspec", dict(total_tokens=7)),
                         ("dyspec-threshold", dict(total_tokens=7, depth=3, threshold=0.02))):
        tree, _ = run(kind, table, ids, roots, seed=seed if sampled else None,
                      temperature=0.8, **static)
        assert tree.sampled == sampled and tree.num_nodes == 8
        check_invariants(head(tree))


def ref_threshold(table, ids, root: int, thr: float, depth: int, budget: int,
                  value: str = "accept", frontier: int | None = None) -> tuple[frozenset, list]:
    """Algorithm 2 in plain Python: per layer, the slots worth >= thr, best first; of the
    kept nodes, the ``frontier`` of highest path value >= thr are expanded (while budget is
    left). Returns the nodes and, per layer before the last, whether any was expanded."""
    nodes, front, expanded = {(root,)}, [(root,)], []
    for d in range(depth):
        cands = []
        for path in front:
            for k, (tok, _) in enumerate(children(table, ids, path)):
                v = slot_value(table, ids, path, k, value)
                if v < thr:
                    break  # values only fall along the drafted order
                cands.append((-v, len(cands), path + (tok,),
                              slot_value(table, ids, path, k, "accept")))
        kept = sorted(cands)[: budget + 1 - len(nodes)]
        nodes |= {c[2] for c in kept}
        if d == depth - 1:
            break
        able = [c for c in kept if c[3] >= thr] if len(nodes) <= budget else []
        able = sorted(able, key=lambda c: (-c[3], c[1]))[: frontier or budget]
        front = [c[2] for c in sorted(able, key=lambda c: c[1])]
        expanded.append(bool(front))
    return frozenset(nodes), expanded


@pytest.mark.parametrize("seed,budget,value,frontier,thr,depth", [
    (0, 24, "accept", None, 0.03, 3), (3, 24, "accept", None, 0.03, 3),
    (4, 5, "accept", None, 0.03, 3), (0, 24, "reach", None, 0.03, 3),
    (4, 5, "reach", None, 0.03, 3), (0, 24, "accept", 2, 0.03, 3),
    (3, 24, "reach", 3, 0.03, 3), (0, 12, "accept", None, 0.1, 4),
    (2, 12, "accept", 1, 0.1, 4), (1, 12, "reach", 2, 0.2, 4)])
def test_threshold_keeps_the_slots_above_it(seed, budget, value, frontier, thr, depth):
    """The nodes of algorithm 2 (with a frontier cap), and a drafter call only for the
    layers where some row has a node worth expanding (seed 0 at 0.1 skips two of three)."""
    table, ids = random_table(seed), shortlist_ids(seed, False)
    roots = random_roots(seed, B)
    tree, calls = run("dyspec-threshold", table, ids, roots, total_tokens=budget, depth=depth,
                      threshold=thr, value=value, frontier=frontier)
    layers = []
    for r in range(B):
        nodes, expanded = ref_threshold(table, ids, int(roots[r]), thr, depth, budget, value,
                                        frontier)
        assert frozenset(token_paths(tree, r)) == nodes
        layers.append(expanded)
    assert int(calls) == 1 + sum(map(any, zip(*layers, strict=True)))  # root, then layers


def test_threshold_matches_greedy_at_its_last_value():
    """With the threshold at the value of the greedy tree's last slot, algorithm 2 keeps
    the same nodes as algorithm 1 (the paper's remark), given enough layers."""
    table, ids = random_table(5), shortlist_ids(5, False)
    roots = random_roots(5, B)
    n = 6
    greedy, _ = run("dyspec", table, ids, roots, total_tokens=n)
    for r in range(2):  # each threshold is a compiled program: two rows are enough
        nodes = frozenset(token_paths(greedy, r))
        values = [slot_value(table, ids, node[:-1],
                             [t for t, _ in children(table, ids, node[:-1])].index(node[-1]))
                  for node in nodes if len(node) > 1]
        thr = min(values) * (1 - 1e-4)
        layered, _ = run("dyspec-threshold", table, ids, roots[r:r + 1], total_tokens=n,
                         depth=n, threshold=float(thr))
        assert frozenset(token_paths(layered, 0)) == nodes


def test_sampled_first_child_follows_q():
    table = (1.5 * np.random.default_rng(7).normal(size=(23, C))).astype(np.float32)
    ids = np.arange(C, dtype=np.int32)
    roots = np.full(N_SAMPLES, 3)
    q, _ = first_two_draw_dists(table, 3)
    for kind, static in (("dyspec", dict(total_tokens=4)),
                         ("dyspec-threshold", dict(total_tokens=4, depth=2, threshold=0.01))):
        tree, _ = run(kind, table, ids, roots, seed=11, temperature=TEMP, **static)
        # Node 1 in breadth-first layout is the root's first draw: ~ q, whatever was kept
        # after it (the decision to draw it never looked at it).
        assert (np.asarray(tree.parent[:, 1]) == 0).all()
        assert chi2_pvalue(np.asarray(tree.tokens[:, 1]), q) > 1e-3


@pytest.mark.parametrize("kind, static", [
    ("dyspec", dict(total_tokens=3)),
    ("dyspec-threshold", dict(total_tokens=3, depth=1, threshold=0.001))])
def test_greedy_children_are_q_top_tried_last(kind, static):
    """``greedy=1`` on a root with three children: the last is q's top token, marked fixed;
    the first is drawn from q without it (the law the tree's draft_dist then holds), and
    the second is the next draw without replacement from that law."""
    table = (1.5 * np.random.default_rng(7).normal(size=(23, C))).astype(np.float32)
    ids = np.arange(C, dtype=np.int32)
    q, _ = first_two_draw_dists(table, 3)
    top = int(np.argmax(q))
    rest = np.where(np.arange(C) == top, 0.0, q) / (1 - q[top])
    second = np.array([sum(rest[x] * rest[y] / (1 - rest[x]) for x in range(C) if x != y)
                       for y in range(C)])
    tree, _ = run(kind, table, ids, np.full(N_SAMPLES, 3), seed=12, temperature=TEMP,
                  greedy=1, **static)
    check_invariants(tree)
    fixed, tokens = np.asarray(tree.fixed), np.asarray(tree.tokens)
    valid = np.asarray(tree.valid)
    assert valid.all() and (np.asarray(tree.parent)[:, 1:] == 0).all()
    assert (tokens[:, 3] == top).all() and (fixed == [False, False, False, True]).all()
    np.testing.assert_allclose(np.asarray(tree.draft_dist[0, 0, :C]), rest, rtol=1e-4,
                               atol=1e-7)

    def pvalue_on_support(samples, probs):  # the top token has probability 0: never drawn
        counts = np.bincount(samples, minlength=C)
        assert counts[probs == 0].sum() == 0
        return scipy.stats.chisquare(counts[probs > 0], probs[probs > 0] * len(samples)).pvalue

    assert pvalue_on_support(tokens[:, 1], rest) > 1e-3
    assert pvalue_on_support(tokens[:, 2], second) > 1e-3
    # Greedy drafting ignores it: the same tree as without, and nothing marked fixed.
    plain, _ = run(kind, table, ids, np.full(B, 3), **static)
    again, _ = run(kind, table, ids, np.full(B, 3), greedy=1, **static)
    assert again.fixed is None
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_greedy_child_is_kept_when_the_sampled_ones_exhaust_q_rest():
    """q = (0.6, 0.399, 1e-3 spread): the two sampled children take nearly all of q', so
    the chance of *reaching* the third slot is under the threshold, but q's top token is
    accepted with probability about q(top) whatever they took: it is keyed by that and
    kept in every row."""
    q = np.full(C, 1e-3 / (C - 2))
    q[:2] = [0.6, 0.399]
    table = np.broadcast_to(np.log(q).astype(np.float32), (23, C))
    tree, _ = run("dyspec-threshold", table, np.arange(C, dtype=np.int32), np.full(B, 3),
                  seed=13, temperature=1.0, total_tokens=3, depth=1, threshold=0.01, greedy=1)
    check_invariants(tree)
    fixed, tokens = np.asarray(tree.fixed), np.asarray(tree.tokens)
    assert (fixed.sum(1) == 1).all() and (tokens[fixed] == 0).all()
    # The sampled second child (reached with chance about 0.0025 < 0.01) was not kept: the
    # top child follows the first sampled one directly, so it is node 2.
    assert fixed[:, 2].all() and not np.asarray(tree.valid)[:, 3].any()


def test_greedy_children_specs():
    spec = TreeSpec("dyspec-threshold", total_tokens=3, depth=1, threshold=0.001,
                    greedy_children=1)
    assert spec.to_json()["greedy_children"] == 1 and TreeSpec.from_json(spec.to_json()) == spec
    assert "greedy_children" not in TreeSpec("dyspec", total_tokens=3).to_json()
    with pytest.raises(ValueError, match="only dyspec trees that sample"):
        TreeSpec("chain", greedy_children=1)
    with pytest.raises(ValueError, match="only dyspec trees that sample.*topk_children"):
        TreeSpec("dyspec", total_tokens=3, topk_children=True, greedy_children=1)
    with pytest.raises(ValueError, match="at least one child is sampled"):
        TreeSpec("dyspec", total_tokens=2, greedy_children=2)
    with pytest.raises(ValueError, match="greedy_children must be an int"):
        TreeSpec("dyspec", total_tokens=3, greedy_children=True)


@pytest.mark.parametrize("spec", [
    TreeSpec("dyspec", total_tokens=6, topk_children=True),
    TreeSpec("dyspec-threshold", total_tokens=6, depth=3, threshold=0.02, frontier=2,
             topk_children=True)])
def test_topk_children_draft_the_greedy_tree_when_sampling(spec):
    """With ``topk_children`` a sampled run drafts exactly the temperature-0 tree, marked
    deterministic (so verification takes the point-mass rule) and without q."""
    table, ids = jnp.asarray(random_table(5)), jnp.asarray(shortlist_ids(5, False))
    roots = np.asarray(random_roots(5, B), np.int32)
    carry = (jnp.zeros((B, spec.total_tokens + 1), jnp.int32), jnp.int32(0))
    greedy, _ = spec.build(make_expand(table, ids), carry, roots, None, 0.0, V_SHORT)
    sampled, _ = spec.build(make_expand(table, ids), carry, roots, jax.random.key(3),
                            jnp.float32(0.8), V_SHORT)
    assert not sampled.sampled and sampled.draft_dist is None
    for a, b in zip(jax.tree.leaves(greedy), jax.tree.leaves(sampled), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_specs():
    with pytest.raises(ValueError, match="threshold"):
        TreeSpec("dyspec-threshold", total_tokens=8)
    assert TreeSpec("dyspec", total_tokens=8).num_nodes == 9
    assert TreeSpec("dyspec", total_tokens=8).max_depth == 8
    # Algorithm 1 has no depth limit; a depth given to it would be silently ignored.
    with pytest.raises(ValueError, match="dyspec trees have no depth limit.*dyspec-threshold"):
        TreeSpec("dyspec", depth=1, total_tokens=3)
    assert TreeSpec("dyspec-threshold", total_tokens=8, depth=3, threshold=0.1).max_depth == 3
    capped = TreeSpec("dyspec-threshold", total_tokens=8, depth=3, threshold=0.1, frontier=2)
    assert capped.to_json()["frontier"] == 2 and TreeSpec.from_json(capped.to_json()) == capped
    assert "frontier" not in TreeSpec("dyspec", total_tokens=8).to_json()
    with pytest.raises(ValueError, match="only dyspec-threshold trees take a frontier"):
        TreeSpec("eagle2", frontier=2)
    with pytest.raises(ValueError, match="frontier must be an int >= 0"):
        TreeSpec("dyspec-threshold", threshold=0.1, frontier=-1)
    topk = TreeSpec("dyspec", total_tokens=8, topk_children=True)
    assert topk.to_json()["topk_children"] and TreeSpec.from_json(topk.to_json()) == topk
    assert not topk.samples_children and TreeSpec("dyspec").samples_children
    assert "topk_children" not in TreeSpec("eagle2").to_json()
    with pytest.raises(ValueError, match="only dyspec trees choose"):
        TreeSpec("chain", topk_children=True)
    with pytest.raises(ValueError, match="topk_children must be a bool"):
        TreeSpec("dyspec", topk_children=1)
    table, ids = random_table(0), shortlist_ids(0, False)
    roots = random_roots(0, B)
    with pytest.raises(ValueError, match="must key slots by 'reach'"):
        run("dyspec", table, ids, roots, seed=0, temperature=0.8, total_tokens=3,
            value="accept")
    with pytest.raises(ValueError, match="'accept' or 'reach'"):
        run("dyspec", table, ids, roots, total_tokens=3, value="best")


# --------------------------------------------------------------------------------------
# Orders
# --------------------------------------------------------------------------------------


def test_dfs_order_is_preorder_and_groups_subtrees():
    table, ids = random_table(2), shortlist_ids(2, False)
    roots = random_roots(2, B)
    tree, _ = run("dyspec", table, ids, roots, total_tokens=15)
    dfs = permute_nodes(tree, dfs_order(tree))
    for r in range(B):
        par, val = np.asarray(dfs.parent[r]), np.asarray(dfs.valid[r])
        anc = np.asarray(dfs.ancestors[r])
        n = int(val.sum())
        assert val[:n].all() and not val[n:].any()
        for i in range(1, n):
            assert par[i] < i
        # Pre-order: every subtree is a contiguous range starting at its root.
        for j in range(n):
            members = np.flatnonzero(anc[:n, j])
            assert (members == np.arange(j, j + len(members))).all()
        assert set(token_paths(dfs, r)) == set(token_paths(tree, r))  # the same tree
    back = permute_nodes(dfs, bfs_order(dfs))
    for name in ("tokens", "parent", "depth", "valid", "ancestors"):
        np.testing.assert_array_equal(np.asarray(getattr(back, name)),
                                      np.asarray(getattr(tree, name)))


def test_mask_blocks():
    anc = np.zeros((1, 40, 40), bool)
    anc[0, np.arange(40), np.arange(40)] = True
    assert int(mask_blocks(jnp.asarray(anc), 16)[0]) == 3  # the diagonal tiles of 48 = 3x16
    anc[0, 39, 0] = True
    assert int(mask_blocks(jnp.asarray(anc), 16)[0]) == 4
