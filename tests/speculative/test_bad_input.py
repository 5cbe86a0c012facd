"""Speculative decoding refuses bad input with a message that says how to fix it."""

from __future__ import annotations

import dataclasses

import pytest
from flax import nnx

import specjax
from specjax.drafter import DrafterConfig, DrafterMismatchError, EagleDrafter
from specjax.loaded import Drafter
from specjax.speculative import TreeSpec


def test_mismatched_drafter(tiny_target):
    other = dataclasses.replace(tiny_target.cfg, vocab_size=512)
    model = EagleDrafter(DrafterConfig(other), rngs=nnx.Rngs(0))
    wrong = Drafter(cfg=model.cfg, params=model.params())
    with pytest.raises(DrafterMismatchError, match="vocab_size: drafter 512 vs target 256"):
        specjax.generate(tiny_target, [[1, 2, 3]], drafter=wrong)


def test_tree_larger_than_the_buffers(tiny_target, fitted_drafter):
    big = TreeSpec("eagle2", depth=6, top_k=8, total_tokens=120)
    with pytest.raises(ValueError, match="121-node draft tree exceeds the model's context"):
        specjax.generate(tiny_target, [[1, 2, 3]], max_new_tokens=140, drafter=fitted_drafter,
                         tree=big)
    with pytest.raises(ValueError, match="exceeds the 6 candidates"):
        TreeSpec("eagle2", depth=2, top_k=2, total_tokens=13)


def test_prompt_that_fills_the_context(tiny_target, fitted_drafter):
    with pytest.raises(ValueError, match="prompt of 250 tokens"):
        specjax.generate(tiny_target, [[7] * 250], max_new_tokens=8, drafter=fitted_drafter)


def test_negative_temperature_and_tree_without_drafter(tiny_target, fitted_drafter):
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        specjax.generate(tiny_target, [[1, 2]], temperature=-0.5, drafter=fitted_drafter)
    with pytest.raises(ValueError, match="needs a drafter"):
        specjax.generate(tiny_target, [[1, 2]], tree=TreeSpec())
    with pytest.raises(ValueError, match="tree kind"):
        TreeSpec("medusa")
