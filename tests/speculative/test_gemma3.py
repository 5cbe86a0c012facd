"""Greedy speculative decoding on a tiny Gemma 3 whose sliding window (8) is shorter than
its prompts: verification sees through the window exactly what vanilla decoding sees."""

from __future__ import annotations

import pytest
from flax import nnx

import specjax
from specjax.drafter import DrafterConfig, DrafterMismatchError, EagleDrafter
from specjax.loaded import Drafter
from specjax.tree import TreeSpec
from tests.speculative.conftest import fit_drafter
from tests.tiny import GEMMA3, make_hf_checkpoint

# Longer than the window, so the tree's nodes sit past its edge from the first step.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [40, 41, 42]]
assert len(PROMPTS[0]) > GEMMA3["sliding_window"]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gemma3_spec")
    return specjax.load(specjax.convert(make_hf_checkpoint(tmp / "hf", "gemma3"), tmp / "sj",
                                        progress=False))


@pytest.fixture(scope="module")
def vanilla(gemma):
    return specjax.generate(gemma, PROMPTS, max_new_tokens=40, stop_on_eos=False).tokens


@pytest.fixture(scope="module")
def drafter(gemma, vanilla):
    """Fitted to the target's own greedy text, so steps accept deep paths."""
    return fit_drafter(gemma, [p + g for p, g in zip(PROMPTS, vanilla, strict=True)],
                       steps=150)


def test_greedy_equals_vanilla_past_the_window(gemma, vanilla, drafter):
    """The default attention path; tests/model/test_gemma3.py checks the tree-attention
    paths ("xla", "ref") node by node at the window's edge."""
    res = specjax.generate(gemma, PROMPTS, max_new_tokens=40, stop_on_eos=False,
                           drafter=drafter, tree=TreeSpec("eagle2", depth=4, top_k=3,
                                                          total_tokens=10))
    assert res.tokens == vanilla
    lens = [n for row in res.stats["accept_lengths"] for n in row]
    assert max(lens) >= 3 and res.stats["mean_accepted_length"] > 1.5, lens


def test_a_drafter_for_another_target_is_refused(gemma, tiny_target):
    other = EagleDrafter(DrafterConfig(tiny_target.cfg), rngs=nnx.Rngs(0))
    with pytest.raises(DrafterMismatchError, match="model_type: drafter llama vs target "
                                                   "gemma3_text"):
        specjax.generate(gemma, PROMPTS, max_new_tokens=4,
                         drafter=Drafter(cfg=other.cfg, params=other.params()))
