"""Drafters with more than one decoder layer: cache, checkpoints, growth, the loop."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from specjax.checkpoint import MANIFEST, CheckpointError
from specjax.drafter import (
    DrafterConfig,
    DrafterParams,
    EagleDrafter,
    drafter_hidden,
    init_drafter_cache,
    read_drafter,
    save_drafter,
    tapped_features,
)
from specjax.loaded import Drafter
from specjax.model import LayerParams
from specjax.tree import TreeSpec
from tests.drafter.test_drafter import TARGET, _inputs, blockwise_hidden
from tests.speculative.conftest import PROMPTS


@pytest.fixture(scope="module")
def deep():
    return EagleDrafter(DrafterConfig(TARGET, num_layers=3), rngs=nnx.Rngs(1))


def test_incremental_drafting_equals_training_pass(deep):
    """Each layer writes its own cache rows: blockwise drafting = one teacher-forced pass."""
    embed, tokens, feats = _inputs(seed=3)
    assert len(init_drafter_cache(deep.cfg, 2, 16).k) == 3
    np.testing.assert_allclose(
        blockwise_hidden(deep, embed, tokens, feats, ((0, 4), (4, 5), (5, 12))),
        np.asarray(deep(embed, tokens, feats)), atol=1e-5)
    # Only the first layer drops its input norm: the others read a residual stream.
    norms = [lp.attn_norm is None for lp in deep.params().layers]
    assert norms == [True, False, False]


def test_grown_layers_start_as_the_identity():
    """A drafter grown from a one-layer one predicts exactly as it did, until trained."""
    rngs = nnx.Rngs(0)
    one = EagleDrafter(DrafterConfig(TARGET), rngs=rngs)
    init = dataclasses.replace(one.params().layers[0], attn_norm=jnp.ones((TARGET.hidden_size,)))
    two = EagleDrafter(DrafterConfig(TARGET, num_layers=2), rngs=rngs, init_layer=init)
    two.fc[...] = one.fc[...]
    embed, tokens, feats = _inputs()
    np.testing.assert_allclose(np.asarray(two(embed, tokens, feats)),
                               np.asarray(one(embed, tokens, feats)), atol=1e-6)
    g = jax.grad(lambda dp: jnp.mean(drafter_hidden(
        dp, two.cfg, embed, tokens, feats, jnp.broadcast_to(jnp.arange(12), (2, 12)),
        init_drafter_cache(two.cfg, 2, 12))[0] ** 2))(two.params())
    assert float(jnp.abs(g.layers[1].wo).sum()) > 0  # the added layer learns from step 1


def test_checkpoint_round_trip_old_manifests_and_a_lying_config(deep, tmp_path):
    out = save_drafter(tmp_path / "d", deep.cfg, deep.params())
    cfg, params, _ = read_drafter(out, TARGET)
    assert cfg == deep.cfg and len(params.layers) == 3
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(deep.params()), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    one = EagleDrafter(DrafterConfig(TARGET), rngs=nnx.Rngs(0))
    old = save_drafter(tmp_path / "old", one.cfg, one.params())
    manifest = json.loads((old / MANIFEST).read_text())
    assert all(not n.startswith("layers.") for n in manifest["tensors"])  # "layer.*" as before
    del manifest["config"]["num_layers"]  # a folder written before deeper drafters
    (old / MANIFEST).write_text(json.dumps(manifest))
    assert read_drafter(old, TARGET)[0].num_layers == 1

    manifest["config"]["num_layers"] = 2
    (old / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="num_layers=2 but the tensors hold 1 layers"):
        read_drafter(old, TARGET)
    manifest["config"]["num_layers"] = 0
    (old / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="num_layers must be an integer >= 1"):
        read_drafter(old, TARGET)
    with pytest.raises(ValueError, match="at least one decoder layer"):
        DrafterConfig(TARGET, num_layers=0)


def test_greedy_equals_vanilla_with_a_two_layer_drafter(tiny_target, fitted_drafter):
    """The fitted drafter's layer under a second, random layer: a poor drafter, never a
    different output; the identity-started one accepts exactly as the fitted drafter."""
    vanilla = specjax.generate(tiny_target, PROMPTS, max_new_tokens=32,
                               stop_on_eos=False).tokens
    fitted = fitted_drafter.params
    cfg = dataclasses.replace(fitted_drafter.cfg, num_layers=2)
    grown = EagleDrafter(cfg, rngs=nnx.Rngs(0), init_layer=tiny_target.params.layers[-1])
    identity_second = grown.params().layers[1]
    rs = np.random.RandomState(0)
    noisy_second = jax.tree.map(lambda a: jnp.asarray(a + 0.05 * rs.randn(*a.shape), a.dtype),
                                identity_second)
    tree = TreeSpec("eagle2", depth=4, top_k=3, total_tokens=10)
    stats = {}
    for name, second in (("identity", identity_second), ("noisy", noisy_second)):
        dp = DrafterParams(fc=fitted.fc, layers=(fitted.layers[0], second),
                           fc_bias=fitted.fc_bias)
        res = specjax.generate(tiny_target, PROMPTS, max_new_tokens=32, stop_on_eos=False,
                               drafter=Drafter(cfg=cfg, params=dp), tree=tree)
        assert res.tokens == vanilla, name
        stats[name] = res.stats["accept_lengths"]
    one = specjax.generate(tiny_target, PROMPTS, max_new_tokens=32, stop_on_eos=False,
                           drafter=fitted_drafter, tree=tree)
    assert stats["identity"] == one.stats["accept_lengths"]


def test_drafter_takes_the_targets_layout(deep, tiny_target, fitted_drafter):
    """A drafter run beside an out-major target ([out, in] products, the CPU rowdot layout)
    gets that layout too (layers, fc, tap_fc), for inference only: the same hidden states
    and tapped features at 1, 5 and 40 rows (kernel, kernel, XLA's dot), the stored params
    untouched; a target in the [in, out] layout leaves the drafter as it is."""
    from specjax.drafter import in_target_layout
    from specjax.model import fuse_params, is_out_major, to_out_major, unfuse_params
    from specjax.runner import SpecRunner
    from specjax.sampling import SamplingConfig
    from specjax.vocab.head import full_head

    target_om = to_out_major(unfuse_params(tiny_target.params))
    stored = deep.params()
    laid = in_target_layout(stored, target_om)
    assert all(lp.out_major for lp in laid.layers) and laid.layers[0].attn_norm is None
    assert laid.out_major and laid.fc.shape == stored.fc.shape[::-1] and not stored.out_major
    assert isinstance(stored.layers[0], LayerParams)  # the input is not changed
    assert in_target_layout(stored, target_om) is laid  # kept while `stored` lives
    assert in_target_layout(stored, fuse_params(unfuse_params(tiny_target.params))) is stored
    embed, tokens, feats = _inputs(b=1, t=40, seed=5)
    for t in (1, 5, 40):
        pos = jnp.arange(t)[None]
        a, _ = drafter_hidden(laid, deep.cfg, embed, tokens[:, :t], feats[:, :t], pos,
                              init_drafter_cache(deep.cfg, 1, 48))
        b, _ = drafter_hidden(stored, deep.cfg, embed, tokens[:, :t], feats[:, :t], pos,
                              init_drafter_cache(deep.cfg, 1, 48))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=0,
                                   err_msg=f"T={t}")
    # A tapped drafter's tap_fc is laid out too (random here: a fresh one starts at zero).
    tapped = EagleDrafter(DrafterConfig(TARGET, num_layers=2, taps=(0, 1)), rngs=nnx.Rngs(2))
    d = TARGET.hidden_size
    stored_t = dataclasses.replace(tapped.params(), tap_fc=0.05 * jax.random.normal(
        jax.random.key(7), (2 * d, d)))
    laid_t = in_target_layout(stored_t, target_om)
    assert laid_t.tap_fc.shape == (d, 2 * d)
    hidden, *taps = (jax.random.normal(jax.random.key(i), (1, 40, d)) for i in range(3))
    for t in (1, 5, 40):
        np.testing.assert_allclose(
            np.asarray(tapped_features(laid_t, hidden[:, :t], tuple(x[:, :t] for x in taps))),
            np.asarray(tapped_features(stored_t, hidden[:, :t], tuple(x[:, :t] for x in taps))),
            atol=2e-5, rtol=0, err_msg=f"taps, T={t}")
    # The runner lays the drafter out as the target it serves (tiny_target: as load chose).
    runner = SpecRunner.of(tiny_target, fitted_drafter, full_head(tiny_target.cfg.vocab_size),
                           TreeSpec(), SamplingConfig(temperature=0.0))
    om = is_out_major(tiny_target.params)
    assert all(getattr(lp, "out_major", False) == om for lp in runner.drafter.params.layers)
    assert isinstance(fitted_drafter.params.layers[0], LayerParams)
