"""Shared fixtures: tiny random HF checkpoints made on the fly."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from tests.tiny import make_hf_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny untied Llama with GQA, saved as an HF folder."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama")
