"""Fixtures of the drafter-training tests: each module that asks gets its own tiny scaled
target and hidden-state cache (module scope: the conftest's compiled programs are dropped
with each module)."""

from __future__ import annotations

import pytest

from tests.train.tiny_data import hidden_cache, scaled_target


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """The tiny random Llama, its embedding and LM head scaled up (:func:`scaled_target`)."""
    return scaled_target(tmp_path_factory.mktemp("train_target"))


@pytest.fixture(scope="module")
def cache(target, tmp_path_factory):
    """The hidden states of :func:`~tests.train.tiny_data.sequences` through ``target``."""
    return hidden_cache(target, tmp_path_factory.mktemp("hidden_cache"))
