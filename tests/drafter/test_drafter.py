"""The EAGLE drafter: NNX training pass = cached inference pass; checkpoints; refusals."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.checkpoint import CheckpointError
from specjax.config import ModelConfig
from specjax.drafter import (
    DrafterConfig,
    DrafterMismatchError,
    EagleDrafter,
    drafter_hidden,
    init_drafter_cache,
    read_drafter,
    save_drafter,
)
from tests.tiny import BASE

TARGET = ModelConfig.from_hf(dict(BASE, model_type="llama", architectures=["LlamaForCausalLM"]))


@pytest.fixture(scope="module")
def drafter():
    return EagleDrafter(DrafterConfig(TARGET), rngs=nnx.Rngs(0))


def _inputs(b=2, t=12, seed=0):
    rs = np.random.RandomState(seed)
    embed = jnp.asarray(rs.randn(TARGET.vocab_size, TARGET.hidden_size), jnp.float32)
    tokens = jnp.asarray(rs.randint(0, TARGET.vocab_size, (b, t)))
    feats = jnp.asarray(rs.randn(b, t, TARGET.hidden_size), jnp.float32)
    return embed, tokens, feats


def blockwise_hidden(drafter, embed, tokens, feats, blocks) -> np.ndarray:
    """The drafter's hidden states over [B, T] tokens drafted block by block through its
    cache, blocks = ((start, end), ...) covering 0..T."""
    cache = init_drafter_cache(drafter.cfg, tokens.shape[0], 16)
    out = []
    for s, e in blocks:
        pos = jnp.broadcast_to(jnp.arange(s, e), (tokens.shape[0], e - s))
        h, cache = drafter_hidden(drafter.params(), drafter.cfg, embed, tokens[:, s:e],
                                  feats[:, s:e], pos, cache)
        cache = dataclasses.replace(cache, lengths=cache.lengths + (e - s))
        out.append(h)
    return np.concatenate(out, 1)


def test_incremental_drafting_equals_training_pass(drafter):
    embed, tokens, feats = _inputs()
    np.testing.assert_allclose(
        blockwise_hidden(drafter, embed, tokens, feats, ((0, 5), (5, 6), (6, 12))),
        np.asarray(drafter(embed, tokens, feats)), atol=1e-5)


def test_no_input_norm_by_default_and_gradients_flow(drafter):
    assert drafter.params().layers[0].attn_norm is None
    embed, tokens, feats = _inputs()

    def loss(model):
        return jnp.mean(model(embed, tokens, feats) ** 2)

    grads = nnx.grad(loss)(drafter)
    norms = jax.tree.leaves(jax.tree.map(lambda g: float(jnp.abs(g).sum()), nnx.state(grads)))
    assert len(norms) >= 10 and all(n > 0 for n in norms)


def test_checkpoint_round_trip_and_mismatch(drafter, tmp_path):
    out = save_drafter(tmp_path / "d", drafter.cfg, drafter.params(), meta={"tokens_seen": 7})
    cfg, params, meta = read_drafter(out, TARGET)
    assert cfg == drafter.cfg and meta == {"tokens_seen": 7}
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(drafter.params()), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    wider = dataclasses.replace(TARGET, hidden_size=128, vocab_size=512)
    with pytest.raises(DrafterMismatchError, match="vocab_size: drafter 256 vs target 512"):
        read_drafter(out, wider)
    with pytest.raises(DrafterMismatchError, match="hidden_size: drafter 64 vs target 128"):
        read_drafter(out, wider)
    with pytest.raises(DrafterMismatchError, match="model_type"):
        read_drafter(out, dataclasses.replace(TARGET, model_type="qwen3", qk_norm=True))
    with pytest.raises(CheckpointError, match="specjax-drafter"):
        from specjax.checkpoint import read_manifest

        (tmp_path / "t").mkdir()
        (tmp_path / "t" / "specjax.json").write_text('{"format": "specjax-target", "version": 1}')
        read_manifest(tmp_path / "t", "specjax-drafter")
