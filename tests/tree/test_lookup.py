"""Lookup chains: the continuation found, the graft's tree invariants, exact decoding."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import specjax
from specjax.loop import PAD
from specjax.tree import TreeSpec, ancestors_from_parent
from specjax.tree.base import DraftTree, finish_tree
from specjax.tree.lookup import (
    committed_history,
    copy_bias,
    gate_root,
    graft_chain,
    graft_lookup,
    lookup_continuation,
)
from tests.speculative.conftest import PROMPTS


def reference_continuation(hist: list[int], length: int,
                           ngram: int) -> tuple[list[int], int] | None:
    """Plain Python: the latest earlier occurrence of the longest suffix (<= ngram), the
    tokens after it (repeating the period when they run into the suffix itself), and the
    suffix's length."""
    n = len(hist)
    for g in range(min(ngram, n - 1), 0, -1):
        for end in range(n - 2, g - 2, -1):  # an occurrence ending at end < n - 1
            if hist[end - g + 1:end + 1] == hist[n - g:]:
                out, src = [], hist[:]
                for _ in range(length):
                    out.append(src[end + 1 + len(out)])
                    src.append(out[-1])
                return out, g
    return None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=14), min_size=1, max_size=4),
       st.integers(1, 5), st.integers(1, 4))
def test_continuation_matches_a_plain_python_reference(rows, length, ngram):
    n = 16
    hist = np.full((len(rows), n), PAD, np.int32)
    for b, r in enumerate(rows):
        hist[b, :len(r)] = r
    toks, match = lookup_continuation(jnp.asarray(hist), jnp.asarray([len(r) for r in rows]),
                                      length, ngram)
    for b, r in enumerate(rows):
        want = reference_continuation(r, length, ngram)
        assert int(match[b]) == (0 if want is None else want[1]), r
        if want is not None:
            assert np.asarray(toks[b]).tolist() == want[0], r


def test_continuation_prefers_the_longest_suffix_then_the_latest():
    # "1 2" occurred at 0-1 (then 7) and "2" alone at 4 (then 9): the two-token match wins.
    hist = [1, 2, 7, 5, 2, 9, 1, 2]
    toks, match = lookup_continuation(jnp.asarray([hist]), jnp.asarray([8]), 3, 2)
    assert int(match[0]) == 2 and np.asarray(toks[0]).tolist() == [7, 5, 2]
    # A repetition loop: the continuation repeats the period instead of running out.
    toks, _ = lookup_continuation(jnp.asarray([[4, 8, 3, 8, 3]]), jnp.asarray([5]), 5, 3)
    assert np.asarray(toks[0]).tolist() == [8, 3, 8, 3, 8]


def test_history_is_prompt_then_output():
    prompt = jnp.asarray([[5, 6, PAD], [7, 8, 9]])
    out = jnp.asarray([[1, 2, PAD, PAD], [3, PAD, PAD, PAD]])
    hist, lens = committed_history(prompt, out, jnp.asarray([2, 1]))
    assert np.asarray(lens).tolist() == [4, 4]
    assert np.asarray(hist).tolist() == [[5, 6, 1, 2, PAD, PAD, PAD],
                                         [7, 8, 9, 3, PAD, PAD, PAD]]


def small_tree() -> DraftTree:
    """Root 0 -> {1: a=10, 2: b=11}; 1 -> {3: c=12}; one padding node 4."""
    tokens = jnp.asarray([[99, 10, 11, 12, 0]])
    parent = jnp.asarray([[-1, 0, 0, 1, 0]])
    depth = jnp.asarray([[0, 1, 1, 2, 1]])
    valid = jnp.asarray([[True, True, True, True, False]])
    anc = ancestors_from_parent(parent, 2)
    z = jnp.zeros((1, 5))
    return finish_tree(tokens, parent, depth, valid, anc, z, z, None, False)


def check_invariants(tree: DraftTree) -> None:
    tok, par, dep, val = (np.asarray(x[0]) for x in (tree.tokens, tree.parent, tree.depth,
                                                     tree.valid))
    t = len(tok)
    assert par[0] == -1 and all(par[i] < i for i in range(1, t))
    for i in range(1, t):
        if val[i]:
            assert val[par[i]] and dep[i] == dep[par[i]] + 1
    want = np.asarray(ancestors_from_parent(tree.parent, t))[0]
    got = np.asarray(tree.ancestors[0])
    assert (got[val] == want[val]).all()
    # No node has two valid children with one token: verification tries distinct drafts.
    kids = [(par[i], tok[i]) for i in range(1, t) if val[i]]
    assert len(kids) == len(set(kids))


@pytest.mark.parametrize("chain, grafted", [
    ([10, 12, 13, 14], [(3, 13), (5, 14)]),  # follows a -> c, hangs 13, 14 below c
    ([11, 15, 16, 17], [(2, 15), (5, 16), (6, 17)]),  # follows b, then three new nodes
    ([20, 21, 22, 23], [(0, 20), (5, 21), (6, 22), (7, 23)]),  # a new branch of the root
    ([10, 12, 99, 98], [(3, 99), (5, 98)]),
])
def test_graft_follows_the_tree_then_adds_the_rest(chain, grafted):
    tree = graft_chain(small_tree(), jnp.asarray([chain]), jnp.asarray([True]))
    assert tree.num_nodes == 9
    check_invariants(tree)
    new = [(int(p), int(t)) for p, t, v in zip(tree.parent[0, 5:], tree.tokens[0, 5:],
                                               tree.valid[0, 5:], strict=True) if v]
    assert new == grafted


def test_a_row_without_a_chain_gets_padding():
    tree = graft_chain(small_tree(), jnp.asarray([[20, 21, 22]]), jnp.asarray([False]))
    assert not np.asarray(tree.valid[0, 5:]).any()
    check_invariants(tree)


def test_graft_lookup_takes_a_chain_where_the_match_is_long_enough_and_the_row_live():
    """Three rows of one tree: a two-token match, a one-token match (under lookup_min = 2),
    and a two-token match on a finished row. Only the first takes the chain, which is what
    ``graft_chain`` makes of the text that followed its match."""
    tree = small_tree()
    tree = dataclasses.replace(tree, **{f.name: jnp.concatenate([getattr(tree, f.name)] * 3)
                                       for f in dataclasses.fields(tree)
                                       if isinstance(getattr(tree, f.name), jnp.ndarray)})
    prompt = jnp.asarray([[1, 2, 20, 21, 1], [3, 2, 20, 21, 1], [1, 2, 20, 21, 1]])
    out = jnp.asarray([[2, PAD], [2, PAD], [2, PAD]])  # each history ends "1 2" or "... 2"
    spec = TreeSpec("chain", depth=2, lookup=3, lookup_ngram=2, lookup_min=2)
    grafted, chained = graft_lookup(tree, spec, prompt, out, jnp.asarray([1, 1, 1]),
                                    live=jnp.asarray([True, True, False]))
    assert np.asarray(chained).tolist() == [True, False, False]
    want = graft_chain(small_tree(), jnp.asarray([[20, 21, 1]]), jnp.asarray([True]))
    for name in ("tokens", "parent", "valid"):
        assert (np.asarray(getattr(grafted, name)[0]) == np.asarray(getattr(want, name)[0])).all()
    assert not np.asarray(grafted.valid[1:, 5:]).any()


def test_spec_json_keeps_old_trees_and_checks_sizes():
    old = TreeSpec("chain", depth=2)
    assert "lookup" not in old.to_json()
    t = TreeSpec("chain", depth=2, lookup=5)
    assert t.num_nodes == 3 + 5 and t.max_depth == 5
    assert TreeSpec.from_json(t.to_json()) == t
    with pytest.raises(ValueError, match="lookup must be an int >= 0"):
        TreeSpec(lookup=-1)
    with pytest.raises(ValueError, match="lookup_ngram must be an int >= 1"):
        TreeSpec(lookup=2, lookup_ngram=0)
    with pytest.raises(ValueError, match="cannot exceed lookup_ngram"):
        TreeSpec(lookup=2, lookup_ngram=2, lookup_min=3)


def test_copy_bias_is_the_bonus_of_the_match_length():
    """Row 0 ends "1 2 3", which occurred before (then 7): m = 3 with three bonuses, capped
    at 2 with two; row 1's last token never occurred before: no bonus."""
    prompt = jnp.asarray([[1, 2, 3, 7, 1, 2], [4, 5, 6, PAD, PAD, PAD]])
    out = jnp.asarray([[3, PAD], [8, PAD]])
    num_new = jnp.asarray([1, 1])
    tok, bonus = copy_bias(TreeSpec("chain", copy_bias=(0.5, 2.0, 9.0)), prompt, out, num_new)
    assert np.asarray(tok[0]) == 7 and np.asarray(bonus).tolist() == [9.0, 0.0]
    _, bonus = copy_bias(TreeSpec("chain", copy_bias=(0.5, 2.0)), prompt, out, num_new)
    assert np.asarray(bonus).tolist() == [2.0, 0.0]


def test_gate_root_adds_the_bonus_or_puts_the_token_in_the_lowest_slot():
    """Row 0 offers the token (7): its logit gains the bonus. Row 1 lacks it (9) and has a
    padding slot, which takes it with the drafter's own logit h . w[9] plus the bonus.
    Row 2 lacks it (3) with every slot valid: the lowest logit's slot (id 6) gives way.
    Row 3 has no match (bonus 0): nothing moves."""
    from specjax.vocab.head import Candidates

    w = jnp.arange(40.0).reshape(10, 4) / 10
    h = jnp.ones((4, 1, 4))
    ids = jnp.asarray([[[5, 7, 0]], [[5, 7, 0]], [[5, 6, 7]], [[5, 6, 7]]])
    valid = jnp.asarray([[[True, True, False]], [[True, True, False]], [[True] * 3],
                         [[True] * 3]])
    logits = jnp.where(valid, jnp.asarray([1.0, 0.0, 0.5]), -jnp.inf)
    got = gate_root(Candidates(ids, valid, logits), h, w, jnp.asarray([7, 9, 3, 7]),
                    jnp.asarray([3.0, 3.0, 3.0, 0.0]))
    own = lambda t: float(w[t].sum())  # noqa: E731
    assert np.asarray(got.ids[:, 0]).tolist() == [[5, 7, 0], [5, 7, 9], [5, 3, 7], [5, 6, 7]]
    assert np.asarray(got.valid[:, 0]).tolist() == [[True, True, False], [True] * 3,
                                                    [True] * 3, [True] * 3]
    want = [[1.0, 3.0, -np.inf], [1.0, 0.0, own(9) + 3.0], [1.0, own(3) + 3.0, 0.5],
            [1.0, 0.0, 0.5]]
    np.testing.assert_allclose(np.asarray(got.logits[:, 0]), want, rtol=1e-6)


def test_copy_bias_json_and_checks():
    t = TreeSpec("chain", depth=2, lookup=4, copy_bias=(1, 2.5))
    assert t.copy_bias == (1.0, 2.5) and t.to_json()["copy_bias"] == [1.0, 2.5]
    assert TreeSpec.from_json(t.to_json()) == t and t.reads_history
    assert "copy_bias" not in TreeSpec("chain", depth=2).to_json()
    assert TreeSpec("chain", copy_bias=(1.0,)).reads_history
    assert not TreeSpec("chain").reads_history
    for bad in ([1.0], (float("nan"),), (True,), ("1",), (-1.0,)):
        with pytest.raises(ValueError, match="copy_bias must be a tuple of finite numbers"):
            TreeSpec("chain", copy_bias=bad)


@pytest.mark.parametrize("tree", [TreeSpec("chain", depth=1, copy_bias=(2.0, 4.0, 8.0)),
                                  TreeSpec("static", paths=((0,), (1,), (0, 0)), lookup=4,
                                           lookup_min=2, copy_bias=(1.0, 8.0))])
def test_a_copy_gate_keeps_greedy_output_and_drafts_copies(tiny_target, tree):
    """The random target's greedy loops are copies that an untrained drafter cannot
    guess: the gate ranks the copy first, so a chain of depth 1 accepts more, and every
    output is vanilla's."""
    from specjax.bench.phases import random_drafter

    drafter = random_drafter(tiny_target)
    want = specjax.generate(tiny_target, PROMPTS, max_new_tokens=64, stop_on_eos=False)
    got, base = (specjax.generate(tiny_target, PROMPTS, max_new_tokens=64, stop_on_eos=False,
                                  drafter=drafter, tree=t)
                 for t in (tree, dataclasses.replace(tree, copy_bias=())))
    assert got.tokens == want.tokens
    if tree.lookup:  # the chain takes the copies already; the gate only reorders the root
        assert got.stats["mean_accepted_length"] >= base.stats["mean_accepted_length"]
    else:
        assert got.stats["mean_accepted_length"] > base.stats["mean_accepted_length"] + 0.3


@pytest.mark.parametrize("tree", [TreeSpec("chain", depth=2, lookup=4),
                                  TreeSpec("chain", depth=2, lookup=4, lookup_min=2),
                                  TreeSpec("eagle2", depth=3, top_k=3, total_tokens=6, lookup=6),
                                  TreeSpec("dyspec", total_tokens=6, lookup=3),
                                  # a wide root and a second level (static trees the
                                  # greedy calibration weighs; SmolLM2's ships `0 1 2`)
                                  TreeSpec("static", paths=((0,), (1,), (2,), (0, 0)),
                                           lookup=4, lookup_min=2)])
def test_greedy_equals_vanilla_and_the_chain_is_accepted(tiny_target, fitted_drafter, tree):
    # A random target's greedy text falls into loops, which the lookup chain copies.
    want = specjax.generate(tiny_target, PROMPTS, max_new_tokens=64, stop_on_eos=False)
    got = specjax.generate(tiny_target, PROMPTS, max_new_tokens=64, stop_on_eos=False,
                           drafter=fitted_drafter, tree=tree)
    assert got.tokens == want.tokens
    base = specjax.generate(tiny_target, PROMPTS, max_new_tokens=64, stop_on_eos=False,
                            drafter=fitted_drafter,
                            tree=dataclasses.replace(tree, lookup=0))
    assert got.stats["mean_accepted_length"] > base.stats["mean_accepted_length"]
    if tree.kind == "chain":  # a commit longer than the chain alone can make
        assert max(n for row in got.stats["accept_lengths"] for n in row) > tree.depth + 1
    # Both branches of verify_phase's cond ran (early steps find no earlier occurrence).
    assert 0 < got.stats["chained_fraction"] < 1


def test_eager_takes_the_same_steps_as_compiled(tiny_target, fitted_drafter):
    tree = TreeSpec("chain", depth=2, lookup=4, lookup_min=2)
    runs = [specjax.generate(tiny_target, PROMPTS, max_new_tokens=40, stop_on_eos=False,
                             drafter=fitted_drafter, tree=tree, mode=mode)
            for mode in ("compiled", "eager")]
    assert runs[0].tokens == runs[1].tokens
    for key in ("accept_lengths", "chained_fraction"):
        assert runs[0].stats[key] == runs[1].stats[key]
