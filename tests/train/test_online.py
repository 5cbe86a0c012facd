"""EvoSpec's online alignment: LoRA merge, the eq. 5 loss, updates, and the session."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.drafter import drafter_hidden, init_drafter_cache
from specjax.model import forward_hidden, init_cache, unfuse_layer
from specjax.speculative import TreeSpec
from specjax.train.online import (
    LORA_TARGETS,
    OnlineConfig,
    alignment_loss,
    draft_horizon,
    gather_anchors,
    init_lora,
    make_optimizer,
    memory_bytes,
    merge,
    num_anchors,
    update_jit,
    update_on_batches_jit,
)
from specjax.train.online_session import OnlineSession, collect_samples, drop_oldest
from specjax.vocab.arc import ArcConfig
from specjax.vocab.evospec import evospec_head
from specjax.vocab.head import full_head
from tests.speculative.conftest import PROMPTS

OC = OnlineConfig(rank=4, alpha=8.0, buffer=4, horizon=3, top_k=8, lr=1e-2)


def _sequence(target):
    ids = PROMPTS[1] + specjax.generate(target, [PROMPTS[1]], max_new_tokens=24,
                                        stop_on_eos=False).tokens[0]
    return ids, len(PROMPTS[1])


def _two_layers(drafter):
    """The fitted drafter with a copy of its layer stacked on top (a two-layer drafter)."""
    cfg = dataclasses.replace(drafter.cfg, num_layers=2)
    layer = unfuse_layer(drafter.params.layers[0])
    return cfg, dataclasses.replace(drafter.params, layers=(layer, layer))


@pytest.mark.parametrize("targets", [("wq", "wv"), LORA_TARGETS,
                                     ("wq", "wv", "wq@1", "wv@1", "w_down@1")])
def test_zero_deltas_leave_the_drafter_unchanged(tiny_target, fitted_drafter, targets):
    cfg, params = fitted_drafter.cfg, fitted_drafter.params
    if any("@" in t for t in targets):
        cfg, params = _two_layers(fitted_drafter)
    lora = init_lora(cfg, 4, 8.0, jax.random.PRNGKey(0), targets)
    merged = merge(params, lora)
    for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    # A delta moves exactly the matrix it names (fc, or layer i's for "name@i", the first's
    # for a plain name) and nothing else.
    for name in targets:
        moved = dataclasses.replace(lora, b={**lora.b, name: lora.b[name] + 1.0})
        got = merge(params, moved)
        delta = lora.scale * lora.a[name] @ (lora.b[name] + 1.0)
        matrix, _, at = name.partition("@")
        want = dataclasses.replace(params, layers=tuple(map(unfuse_layer, params.layers)))
        if name == "fc":
            want = dataclasses.replace(want, fc=params.fc + delta)
        else:
            i = int(at or 0)
            layer = want.layers[i]
            layer = dataclasses.replace(layer, **{matrix: getattr(layer, matrix) + delta})
            want = dataclasses.replace(want, layers=(*want.layers[:i], layer,
                                                     *want.layers[i + 1:]))
        got = dataclasses.replace(got, layers=tuple(map(unfuse_layer, got.layers)))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match="LoRA target 'w_in': expected one of"):
        OnlineConfig(targets=("wq", "w_in"))
    with pytest.raises(ValueError, match="not fc"):
        OnlineConfig(targets=("fc@1",))
    with pytest.raises(ValueError, match="distinct"):
        OnlineConfig(targets=("wq", "wq@0"))
    with pytest.raises(ValueError, match="the drafter has 1 layer"):
        init_lora(fitted_drafter.cfg, 4, 8.0, jax.random.PRNGKey(0), ("wv@1",))
    mem = memory_bytes(lora, params, make_optimizer(OC))
    assert mem["lora_trainable"] < mem["full_trainable"] * 0.75
    assert mem["lora_optimizer"] < mem["full_optimizer"] * 0.75


def test_unrolled_steps_match_a_drafter_fed_its_own_features(tiny_target, fitted_drafter):
    from specjax.train.online import Samples

    ids, p = _sequence(tiny_target)
    dp, cfg, embed = fitted_drafter.params, fitted_drafter.cfg, tiny_target.params.embed
    n, g, w = len(ids), 3, len(ids) + 5
    other = ids[::-1]  # a second sequence in the batch: each anchor reads its own
    toks = jnp.asarray([ids + [0] * 5, other + [0] * 5])
    pos = jnp.broadcast_to(jnp.arange(w), (2, w))
    hid, _, _ = forward_hidden(tiny_target.params, tiny_target.cfg, toks, pos,
                               init_cache(tiny_target.cfg, 2, w))
    feats = jnp.concatenate([jnp.zeros_like(hid[:, :1]), hid[:, :-1]], axis=1)
    # Anchors: the prompt's last row and a later one of sequence 0; a row of sequence 1.
    seq, anchors = jnp.asarray([0, 1, 0]), jnp.asarray([p - 1, p + 2, n - 4])
    m = len(anchors)
    s = Samples(tokens=toks, feats=feats, seq=seq, anchors=anchors,
                top_ids=jnp.zeros((m, g, 2), jnp.int32), top_logits=jnp.zeros((m, g, 2)),
                valid=jnp.ones((m, g), bool))
    h = draft_horizon(dp, cfg, embed, s, g)
    assert h.shape == (m, g, feats.shape[-1])
    for i in range(m):
        # Reference: rows 0..t read the target's features (the whole context, at their
        # positions), row t + j reads row t + j - 1's output.
        b, t = int(seq[i]), int(anchors[i])
        f = feats[b:b + 1, :t + 1]
        for j in range(g):
            ref, _ = drafter_hidden(dp, cfg, embed, toks[b:b + 1, :t + 1 + j], f,
                                    pos[b:b + 1, :t + 1 + j],
                                    init_drafter_cache(cfg, 1, t + 1 + j))
            np.testing.assert_allclose(h[i, j], ref[0, -1], rtol=1e-4, atol=1e-4)
            f = jnp.concatenate([f, ref[:, -1:]], axis=1)


def test_samples_are_gated_on_misses_inside_the_vocabulary(tiny_target, fitted_drafter):
    ids, p = _sequence(tiny_target)
    dp, cfg = fitted_drafter.params, fitted_drafter.cfg
    v = tiny_target.cfg.vocab_size
    s = collect_samples(tiny_target, dp, cfg, ids, p, np.ones(v, bool), OC)
    none_active = np.zeros(v, bool)
    assert collect_samples(tiny_target, dp, cfg, ids, p, none_active, OC) is None
    if s is not None:
        m = num_anchors(s)
        # One sequence, whole: the prompt and the output, room for the last anchor's steps.
        assert s.tokens.shape[0] == 1 and s.tokens.shape[1] >= len(ids) + OC.horizon
        np.testing.assert_array_equal(s.tokens[0, :len(ids)], ids)
        assert s.top_ids.shape == (m, OC.horizon, OC.top_k)
        np.testing.assert_array_equal(s.seq, 0)


def test_without_the_mismatch_gate_every_in_vocabulary_row_is_an_anchor(tiny_target,
                                                                          fitted_drafter):
    ids, p = _sequence(tiny_target)
    dp, cfg = fitted_drafter.params, fitted_drafter.cfg
    v = tiny_target.cfg.vocab_size
    every = collect_samples(tiny_target, dp, cfg, ids, p, np.ones(v, bool), OC,
                            mismatched_only=False)
    first = p - 1
    # A row t in the output's range anchors a draft of ids[t + 1].
    np.testing.assert_array_equal(every.anchors, np.arange(first, len(ids) - 1))
    missed = collect_samples(tiny_target, dp, cfg, ids, p, np.ones(v, bool), OC)
    assert missed is None or num_anchors(missed) <= num_anchors(every)
    # Only rows whose next token is active: drop one output token from the vocabulary.
    active = np.ones(v, bool)
    active[ids[first + 1]] = False
    fewer = collect_samples(tiny_target, dp, cfg, ids, p, active, OC, mismatched_only=False)
    assert num_anchors(fewer) == num_anchors(every) - ids[first + 1:].count(ids[first + 1])


def test_a_batch_gathers_anchors_from_several_sequences(tiny_target, fitted_drafter):
    ids, p = _sequence(tiny_target)
    dp, cfg = fitted_drafter.params, fitted_drafter.cfg
    every = np.ones(tiny_target.cfg.vocab_size, bool)
    parts = [collect_samples(tiny_target, dp, cfg, x, q, every, OC, mismatched_only=False)
             for x, q in ((ids, p), (ids[:p + 6], p), (ids[:p + 3], p))]
    picks = [(2, 0), (0, 4), (2, 1), (0, 0)]
    b = gather_anchors(parts, picks)
    # Parts 0 and 2 are used: two sequences, padded to the longest, in part order.
    assert b.tokens.shape == (2, parts[0].tokens.shape[1])
    np.testing.assert_array_equal(b.seq, [1, 0, 1, 0])
    np.testing.assert_array_equal(b.anchors, [p - 1, p + 3, p, p - 1])
    np.testing.assert_array_equal(b.tokens[1, :parts[2].tokens.shape[1]], parts[2].tokens[0])
    np.testing.assert_array_equal(b.top_ids[1], parts[0].top_ids[4])
    # Padded up to a requested shape with empty sequences.
    big = gather_anchors(parts, picks, n=4, w=2 * b.tokens.shape[1])
    assert big.tokens.shape == (4, 2 * b.tokens.shape[1])
    np.testing.assert_array_equal(big.tokens[2:], 0)
    # The newest anchors, across parts.
    kept = drop_oldest(parts, num_anchors(parts[2]) + 2)
    assert len(kept) == 2 and num_anchors(kept[0]) == 2
    np.testing.assert_array_equal(kept[0].anchors, parts[1].anchors[-2:])


def test_updates_lower_the_loss_on_the_buffer(tiny_target, fitted_drafter):
    ids, p = _sequence(tiny_target)
    dp, cfg = fitted_drafter.params, fitted_drafter.cfg
    every = np.ones(tiny_target.cfg.vocab_size, bool)
    s = collect_samples(tiny_target, dp, cfg, ids, p, every, OC)
    s = jax.tree.map(jnp.asarray, s)
    lora = init_lora(cfg, OC.rank, OC.alpha, jax.random.PRNGKey(0))
    opt = make_optimizer(OC).init(lora)
    args = (dp, cfg, tiny_target.params.embed, tiny_target.params.head, s)
    before, stats = alignment_loss(lora, *args, OC)
    oc = dataclasses.replace(OC, steps_per_update=20)
    lora, opt, st = update_jit(lora, opt, *args, oc)
    after, _ = alignment_loss(lora, *args, OC)
    assert float(after) < 0.8 * float(before)
    assert stats["kl"].shape == (OC.horizon,)


def test_steps_on_stacked_copies_of_a_buffer_are_the_papers_update(tiny_target,
                                                                  fitted_drafter):
    ids, p = _sequence(tiny_target)
    dp, cfg = fitted_drafter.params, fitted_drafter.cfg
    s = jax.tree.map(jnp.asarray, collect_samples(
        tiny_target, dp, cfg, ids, p, np.ones(tiny_target.cfg.vocab_size, bool), OC))
    lora = init_lora(cfg, OC.rank, OC.alpha, jax.random.PRNGKey(0))
    opt = make_optimizer(OC).init(lora)
    args = (dp, cfg, tiny_target.params.embed, tiny_target.params.head)
    oc = dataclasses.replace(OC, steps_per_update=3)
    want, _, st = update_jit(lora, opt, *args, s, oc)
    stacked = jax.tree.map(lambda a: jnp.stack([a] * 3), s)
    got, _, st2 = update_on_batches_jit(lora, opt, *args, stacked, oc)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert float(st["loss_after"]) == pytest.approx(float(st2["loss_after"]), rel=1e-5)


def test_the_vocab_support_adds_the_drafters_mass_outside_the_top_k(tiny_target,
                                                                    fitted_drafter):
    ids, p = _sequence(tiny_target)
    dp, cfg = fitted_drafter.params, fitted_drafter.cfg
    head, embed = tiny_target.params.head, tiny_target.params.embed
    s = jax.tree.map(jnp.asarray, collect_samples(
        tiny_target, dp, cfg, ids, p, np.ones(tiny_target.cfg.vocab_size, bool), OC))
    lora = init_lora(cfg, OC.rank, OC.alpha, jax.random.PRNGKey(0))
    oc = dataclasses.replace(OC, beta=0.0)  # every step weighs 1: the loss is a plain sum
    paper, st = alignment_loss(lora, dp, cfg, embed, head, s, oc)
    vocab, sv = alignment_loss(lora, dp, cfg, embed, head, s,
                               dataclasses.replace(oc, support="vocab"))
    np.testing.assert_allclose(sv["kl"], st["kl"], rtol=1e-5)  # eq. 5's part is unchanged
    # Reference: -log of the drafter's softmax mass on the target's top-K ids.
    q = jax.nn.softmax(draft_horizon(dp, cfg, embed, s, OC.horizon) @ head.T, axis=-1)
    mass = jnp.take_along_axis(q, s.top_ids, axis=-1).sum(-1)  # [N, G]
    outside = jnp.where(s.valid, -jnp.log(mass), 0.0)
    assert float(outside.min()) >= 0.0
    np.testing.assert_allclose(sv["outside"], outside.sum(0) / jnp.maximum(s.valid.sum(0), 1),
                               rtol=1e-4, atol=1e-6)
    assert float(vocab) == pytest.approx(float(paper) + float(outside.sum()) / num_anchors(s),
                                         rel=1e-4)
    with pytest.raises(ValueError, match="support must be one of topk, vocab"):
        OnlineConfig(support="all")


def test_the_horizon_weights_follow_eq_4(tiny_target, fitted_drafter):
    ids, p = _sequence(tiny_target)
    dp, cfg = fitted_drafter.params, fitted_drafter.cfg
    s = jax.tree.map(jnp.asarray, collect_samples(
        tiny_target, dp, cfg, ids, p, np.ones(tiny_target.cfg.vocab_size, bool), OC))
    lora = init_lora(cfg, OC.rank, OC.alpha, jax.random.PRNGKey(0))
    args = (lora, dp, cfg, tiny_target.params.embed, tiny_target.params.head, s)
    _, st = alignment_loss(*args, OC)
    # beta = 0: every step weighs 1, so the loss is the sum of the per-step KLs.
    flat, fst = alignment_loss(*args, dataclasses.replace(OC, beta=0.0))
    assert float(flat) == pytest.approx(float(jnp.sum(fst["kl"] * jnp.sum(s.valid, 0)))
                                        / s.valid.shape[0], rel=1e-4)
    # A huge beta keeps only step 1 (w_1 = 1, the others vanish).
    step1, _ = alignment_loss(*args, dataclasses.replace(OC, beta=1e6))
    assert float(step1) <= float(flat) + 1e-6
    assert float(step1) == pytest.approx(float(st["l_base"]), rel=1e-4)


def _session(target, drafter, adapt=True):
    v = target.cfg.vocab_size
    head = evospec_head(target.params.head, np.arange(v), [0], v // 4, n_dyn=v // 8,
                        arc=ArcConfig(capacity=v // 8, ghost=v // 8, p_init=v // 16, warmup=2,
                                      min_residency=1, max_insert=8))
    return OnlineSession(target, drafter, head, oc=OC, adapt=adapt)


def test_a_session_adapts_and_keeps_greedy_output(tiny_target, fitted_drafter, tmp_path):
    sess = _session(tiny_target, fitted_drafter)
    tree = TreeSpec("chain", depth=3)
    for prompt in PROMPTS * 2:
        res = sess.generate([prompt], max_new_tokens=24, stop_on_eos=False, tree=tree)
        vanilla = specjax.generate(tiny_target, [prompt], max_new_tokens=24,
                                   stop_on_eos=False).tokens
        assert res.tokens == vanilla
    assert sess.stats["updates"] > 0 and sess.stats["samples"] > 0
    assert float(jnp.abs(sess.lora.b["wq"]).max()) > 0  # the deltas moved
    path = sess.save(tmp_path / "session")
    other = _session(tiny_target, fitted_drafter)
    other.restore(path)
    for a, b in zip(jax.tree.leaves((sess.lora, sess.opt_state, sess.vocab_state)),
                    jax.tree.leaves((other.lora, other.opt_state, other.vocab_state)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert other.stats["updates"] == sess.stats["updates"]
    # A session whose LoRA adapts other matrices cannot read it: a clear error, nothing read.
    wider = OnlineSession(tiny_target, fitted_drafter, other.vocab,
                          oc=dataclasses.replace(OC, targets=("wq", "wv", "w_up")))
    with pytest.raises(ValueError, match="holds LoRA on wq, wv; this session adapts w_up, wq, wv"):
        wider.restore(path)
    assert float(jnp.abs(wider.lora.b["wq"]).max()) == 0
    with pytest.raises(FileNotFoundError, match="no saved session"):
        wider.restore(tmp_path / "elsewhere")


def test_a_reset_session_drafts_as_a_new_one(tiny_target, fitted_drafter, tmp_path):
    sess, fresh = _session(tiny_target, fitted_drafter), _session(tiny_target, fitted_drafter)
    tree = TreeSpec("chain", depth=3)
    for prompt in PROMPTS * 2:
        sess.generate([prompt], max_new_tokens=24, stop_on_eos=False, tree=tree)
    assert sess.stats["updates"] > 0 and sess.vocab_state is not None
    updates = sess.stats["updates"]
    sess.reset()
    assert float(jnp.abs(sess.lora.b["wq"]).max()) == 0 and sess.buffer == []
    assert sess.stats["updates"] == updates  # the counts go on across conversations
    # A reset session saves and restores before its first request (the head's initial state).
    sess.restore(sess.save(tmp_path / "reset"))
    for a, b in zip(jax.tree.leaves((sess.lora, sess.opt_state, sess.vocab_state)),
                    jax.tree.leaves((fresh.lora, fresh.opt_state,
                                     fresh.vocab.init_state(1))), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # ... and drafts exactly as a session that never learned anything.
    got = sess.generate([PROMPTS[1]], max_new_tokens=24, stop_on_eos=False, tree=tree)
    want = fresh.generate([PROMPTS[1]], max_new_tokens=24, stop_on_eos=False, tree=tree)
    assert got.stats["mean_accepted_length"] == want.stats["mean_accepted_length"]
    for a, b in zip(jax.tree.leaves(sess.vocab_state), jax.tree.leaves(fresh.vocab_state),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_replay_window_keeps_the_newest_samples_and_updates_per_buffer(tiny_target,
                                                                         fitted_drafter):
    oc = dataclasses.replace(OC, replay=6, steps_per_update=2)
    v = tiny_target.cfg.vocab_size
    sess = OnlineSession(tiny_target, fitted_drafter, full_head(v), oc=oc)
    tree = TreeSpec("chain", depth=2)
    for prompt in PROMPTS * 2:
        res = sess.generate([prompt], max_new_tokens=24, stop_on_eos=False, tree=tree)
        assert res.tokens == specjax.generate(tiny_target, [prompt], max_new_tokens=24,
                                              stop_on_eos=False).tokens
        seen = sess.stats["samples"]
        # Every sample counts towards an update (none discarded); the window holds the last 6.
        assert sess.stats["updates"] * oc.buffer == seen - sess.pending
        assert sess.pending < oc.buffer or sess.window_size() < oc.buffer
        assert sess.window_size() == min(seen, oc.replay)
    assert sess.stats["updates"] > 0, "the fitted drafter should miss often enough to update"
    assert float(jnp.abs(sess.lora.b["wq"]).max()) > 0
    with pytest.raises(ValueError, match="replay window of 3 samples"):
        OnlineSession(tiny_target, fitted_drafter, sess.vocab,
                      oc=dataclasses.replace(OC, replay=3))
