"""The online adapter's prequential guard (OnlineConfig.guard, not the paper's): the adapter
drafts only after it beat the frozen drafter on a request it had not been fitted on."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

import specjax
from specjax.speculative import TreeSpec
from specjax.train.online import OnlineConfig
from specjax.train.online_session import (
    OnlineSession,
    first_drafts,
    guard_counts,
    teacher_forced,
)
from specjax.vocab.head import full_head
from tests.speculative.conftest import PROMPTS

OC = OnlineConfig(rank=4, alpha=8.0, buffer=4, horizon=3, top_k=8, lr=1e-2, guard=True)


def test_guard_counts_only_output_rows_in_the_vocabulary():
    # ids[t + 1] is row t's target token; the prompt is 3 tokens, so rows 2.. are output.
    ids = [5, 6, 7, 1, 2, 3, 4]
    active = np.ones(10, bool)
    active[3] = False  # row 4's token: the buffer's job, not the adapter's
    #                    row: 0  1  2  3  4  5
    adapted = np.array([6, 7, 1, 0, 3, 0, 0])  # hits rows 0, 1, 2 (prompt: 0, 1 not counted)
    frozen = np.array([0, 0, 0, 2, 3, 4, 0])  # hits rows 3, 4 (out of vocabulary), 5
    assert guard_counts(adapted, frozen, ids, 3, active) == (1, 2)
    assert guard_counts(frozen, frozen, ids, 3, active) == (0, 0)
    assert guard_counts(adapted, frozen, ids, 3, np.zeros(10, bool)) == (0, 0)


def test_first_drafts_of_another_drafter_need_only_the_features(tiny_target, fitted_drafter):
    ids = PROMPTS[1] + specjax.generate(tiny_target, [PROMPTS[1]], max_new_tokens=24,
                                        stop_on_eos=False).tokens[0]
    active = np.ones(tiny_target.cfg.vocab_size, bool)
    active[::3] = False
    dp, cfg = fitted_drafter.params, fitted_drafter.cfg
    sess = OnlineSession(tiny_target, fitted_drafter, full_head(active.size), oc=OC)
    sess.lora = jax.tree.map(lambda x: x + 0.3, sess.lora)  # deltas that change drafts
    moved = sess.adapted_drafter().params
    feats, _, _, pred = teacher_forced(tiny_target, moved, cfg, ids, 8, active)
    np.testing.assert_array_equal(first_drafts(tiny_target, moved, cfg, ids, feats, active),
                                  pred)
    # The base over the same features drafts as its own teacher-forced pass.
    np.testing.assert_array_equal(first_drafts(tiny_target, dp, cfg, ids, feats, active),
                                  teacher_forced(tiny_target, dp, cfg, ids, 8, active)[3])
    assert active[pred[:len(ids)]].all()


def test_a_guarded_session_drafts_with_the_base_until_the_adapter_wins(tiny_target,
                                                                      fitted_drafter,
                                                                      tmp_path):
    v = tiny_target.cfg.vocab_size
    sess = OnlineSession(tiny_target, fitted_drafter, full_head(v), oc=OC)
    tree = TreeSpec("chain", depth=3)
    # The tiny drafter's adapter never wins here; the last request is drafted by it anyway.
    for i, prompt in enumerate(PROMPTS * 2):
        if i == 2 * len(PROMPTS) - 1:
            sess.deployed = True
        drafter = sess.current_drafter()
        # Undeployed, the frozen drafter drafts; deployed, the merged adapter.
        want = sess.adapted_drafter() if sess.deployed else fitted_drafter
        for a, b in zip(jax.tree.leaves(drafter.params), jax.tree.leaves(want.params),
                        strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        res = sess.generate([prompt], max_new_tokens=24, stop_on_eos=False, tree=tree)
        assert res.tokens == specjax.generate(tiny_target, [prompt], max_new_tokens=24,
                                              stop_on_eos=False).tokens
        wins, losses = sess.stats["guard"][-1]
        assert sess.deployed == (wins > losses)
    assert sess.stats["guard"][0] == (0, 0)  # zero deltas draft as the base: no evidence
    assert len(sess.stats["guard"]) == sess.stats["requests"] == 2 * len(PROMPTS)
    assert sess.stats["updates"] > 0
    # The flag is part of the saved session, and a reset withdraws the adapter.
    sess.deployed = True
    other = OnlineSession(tiny_target, fitted_drafter, full_head(v), oc=OC)
    other.restore(sess.save(tmp_path / "guarded"))
    assert other.deployed
    other.reset()
    assert not other.deployed and other.current_drafter() is fitted_drafter
    # Without the guard the adapter always drafts.
    free = OnlineSession(tiny_target, fitted_drafter, full_head(v),
                         oc=dataclasses.replace(OC, guard=False))
    assert free.current_drafter() is not fitted_drafter and free.stats["guard"] == []
