"""EvoSpec's head: the buffer it offers, what an OOV event recalls, and lossless decoding."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.speculative import TreeSpec
from specjax.vocab.arc import EMPTY, ArcConfig, observe_event
from specjax.vocab.evospec import EvoSpecHead, evospec_head, first_occurrences
from specjax.vocab.head import Feedback
from tests.speculative.conftest import PROMPTS

V, D = 96, 16


@pytest.fixture(scope="module")
def w():
    return jnp.asarray(np.random.RandomState(0).randn(V, D).astype(np.float32))


def graph(v: int, fanout: int, seed: int = 0) -> np.ndarray:
    """Random successor lists, EMPTY-padded at the end of some rows."""
    rs = np.random.RandomState(seed)
    g = np.stack([rs.permutation(v)[:fanout] for _ in range(v)]).astype(np.int32)
    g[::3, fanout // 2:] = EMPTY
    return g


def test_first_occurrences():
    ids = jnp.asarray([[3, 5, 3, EMPTY, 5, 7, EMPTY]])
    assert first_occurrences(ids).tolist() == [[True, True, False, False, False, True, False]]


def test_an_oov_event_recalls_the_token_its_top_k_and_their_successors(w):
    ranked = np.arange(V)
    g = graph(V, 4)
    head = evospec_head(w, ranked, [0], 20, n_dyn=64, successors=g, fanout=2, recall_k=3,
                        arc=ArcConfig(capacity=64, ghost=64, max_insert=64))
    state = head.init_state(2)
    logits = jnp.asarray(np.random.RandomState(1).randn(2, V).astype(np.float32))
    bonus = jnp.asarray([50, 7])  # row 0: outside the core (0..19); row 1: inside
    fb = Feedback(committed=jnp.asarray([[50, -1], [7, -1]]), bonus=bonus, logits=logits,
                  hidden=jnp.zeros((2, D)), live=jnp.asarray([True, True]))
    new = head.observe(state, fb)
    top = np.argsort(-np.asarray(logits[0]))[:3]
    seeds = [50, *top.tolist()]
    want = [x for x in dict.fromkeys(seeds + [int(s) for u in seeds for s in g[u, :2]])
            if x != EMPTY and x >= 20]
    got = np.asarray(new.arc.ids[0])
    assert sorted(got[got != EMPTY].tolist()) == sorted(want)
    assert new.arc.events.tolist() == [1, 0] and new.step.tolist() == [1, 1]
    assert (np.asarray(new.arc.ids[1]) == EMPTY).all()
    assert bool(head.is_active(new, bonus).all())


def test_the_head_offers_the_core_then_the_buffer(w):
    head = evospec_head(w, np.arange(V)[::-1], [0, 1], 10, n_dyn=8)
    state = head.init_state(2)
    cands = jnp.asarray([[40, 41, EMPTY], [EMPTY] * 3], jnp.int32)
    arc = jax_vmap_event(state.arc, cands, head.arc)
    state = type(state)(arc=arc, step=state.step)
    h = jnp.asarray(np.random.RandomState(2).randn(2, 3, D).astype(np.float32))
    c = head(w, h, 0, state=state)
    assert c.ids.shape == (2, 3, 18) and head.capacity(3) == 18
    core = np.asarray(c.ids[0, 0, :10]).tolist()
    assert core[:2] == [0, 1] and core[2:] == [95, 94, 93, 92, 91, 90, 89, 88]
    valid = np.asarray(c.valid)
    assert valid[0, :, :10].all() and valid[0, :, 10:].sum(-1).tolist() == [2, 2, 2]
    assert valid[1, :, 10:].sum() == 0 and np.isneginf(np.asarray(c.logits)[1, :, 10:]).all()
    offered = np.asarray(c.ids[0, 1])[valid[0, 1]]
    np.testing.assert_allclose(np.asarray(c.logits[0, 1])[valid[0, 1]],
                               np.asarray(w)[offered] @ np.asarray(h[0, 1]), rtol=1e-5, atol=1e-5)
    assert set(offered.tolist()) == set(core) | {40, 41}


def jax_vmap_event(arc, cands, cfg):
    import jax

    return jax.vmap(lambda s, c: observe_event(s, c, jnp.int32(0), cfg))(arc, cands)


def test_bad_sizes_are_refused(w):
    with pytest.raises(ValueError, match="always-kept"):
        evospec_head(w, np.arange(V), [0, 1, 2], 2)
    with pytest.raises(ValueError, match="N_dyn"):
        evospec_head(w, np.arange(V), [0], 90, n_dyn=10)
    with pytest.raises(ValueError, match="rows"):
        evospec_head(w, np.arange(V), [0], 10, n_dyn=8, successors=np.zeros((5, 2), np.int32))


# --- lossless decoding (the target verifies over the full vocabulary) ---


@pytest.mark.parametrize("tree", [TreeSpec("chain", depth=3),
                                  TreeSpec("eagle2", depth=4, top_k=3, total_tokens=10)],
                         ids=["chain", "eagle2"])
def test_greedy_equals_vanilla_while_the_buffer_evolves(tiny_target, fitted_drafter, tree):
    v = tiny_target.cfg.vocab_size
    head = evospec_head(tiny_target.params.head, np.arange(v), [0], v // 8, n_dyn=v // 8,
                        successors=graph(v, 8), fanout=4,
                        arc=ArcConfig(capacity=v // 8, ghost=v // 8, p_init=v // 16, warmup=2,
                                      min_residency=1, max_insert=8))
    vanilla = specjax.generate(tiny_target, PROMPTS, max_new_tokens=32,
                               stop_on_eos=False).tokens
    res = specjax.generate(tiny_target, PROMPTS, max_new_tokens=32, stop_on_eos=False,
                           drafter=fitted_drafter, vocab=head, tree=tree)
    assert res.tokens == vanilla
    s = res.stats
    assert s["vocab"] == head.name
    assert min(s["oov_events"]) > 0 and min(s["insertions"]) > 0
    assert all(0 < n <= head.arc.capacity for n in s["buffer_occupancy"])
    if tree.kind != "chain":
        return
    # The buffer raised coverage above the core alone: some steps' first token came from it.
    core_only = specjax.generate(tiny_target, PROMPTS, max_new_tokens=32, stop_on_eos=False,
                                 drafter=fitted_drafter, tree=tree,
                                 vocab=_frequency(tiny_target, v // 8))
    assert s["shortlist_coverage"] > core_only.stats["shortlist_coverage"]


def _frequency(target, n):
    from specjax.vocab.fr_head import frequency_head

    return frequency_head(target.params.head, np.arange(target.cfg.vocab_size), [0], n)


def test_an_evospec_head_is_a_pytree(w):
    import jax

    head = evospec_head(w, np.arange(V), [0], 10, n_dyn=8)
    leaves, tree = jax.tree.flatten(head)
    assert isinstance(jax.tree.unflatten(tree, leaves), EvoSpecHead)


def test_the_buffer_carries_over_between_requests(tiny_target, fitted_drafter):
    v = tiny_target.cfg.vocab_size
    head = evospec_head(tiny_target.params.head, np.arange(v), [0], v // 8, n_dyn=v // 8,
                        arc=ArcConfig(capacity=v // 8, ghost=v // 8, p_init=v // 16, warmup=2,
                                      min_residency=1, max_insert=8))
    tree = TreeSpec("chain", depth=3)
    kw = dict(max_new_tokens=16, stop_on_eos=False, drafter=fitted_drafter, vocab=head,
              tree=tree)
    first = specjax.generate(tiny_target, PROMPTS[:1], **kw)
    again = specjax.generate(tiny_target, PROMPTS[1:2], vocab_state=first.vocab_state, **kw)
    fresh = specjax.generate(tiny_target, PROMPTS[1:2], **kw)
    assert again.tokens == fresh.tokens  # the buffer changes drafts, never the output
    # The state continued from the first request: its step counter and OOV events add up.
    steps = int(first.vocab_state.step[0])
    assert steps == first.stats["target_forwards"]
    assert int(again.vocab_state.step[0]) == steps + again.stats["target_forwards"]
    assert again.stats["oov_events"][0] >= first.stats["oov_events"][0] > 0
    with pytest.raises(ValueError, match="rows but this call has 3"):
        specjax.generate(tiny_target, PROMPTS, vocab_state=first.vocab_state, **kw)
    with pytest.raises(ValueError, match="stateful"):
        specjax.generate(tiny_target, PROMPTS[:1], vocab_state=first.vocab_state,
                         max_new_tokens=4, drafter=fitted_drafter)
    # A state from a head with a larger buffer, or not a head's state at all.
    bigger = evospec_head(tiny_target.params.head, np.arange(v), [0], v // 8, n_dyn=v // 4,
                          arc=ArcConfig(capacity=v // 4, ghost=v // 4, p_init=v // 8, warmup=2,
                                        min_residency=1, max_insert=8))
    with pytest.raises(ValueError, match="another buffer size"):
        specjax.generate(tiny_target, PROMPTS[1:2], vocab_state=first.vocab_state,
                         **(kw | {"vocab": bigger}))
    with pytest.raises(ValueError, match="does not have the .* head's structure"):
        specjax.generate(tiny_target, PROMPTS[1:2], vocab_state={"step": first.vocab_state.step},
                         **kw)
