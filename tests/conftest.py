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


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' fp32 load of the real SmolLM2-135M-Instruct GGUF (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specjax.defaults import smollm2_gguf_path

    path = smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """The real SmolLM2 GGUF converted by ``specjax convert`` into a fresh folder."""
    from specjax.convert import convert
    from specjax.defaults import smollm2_gguf_path

    return convert(smollm2_gguf_path(), tmp_path_factory.mktemp("smollm2") / "SmolLM2",
                   progress=False)
