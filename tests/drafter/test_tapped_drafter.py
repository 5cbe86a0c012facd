"""Drafters whose feature adds tapped target layers (``DrafterConfig.taps``)."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from specjax.checkpoint import MANIFEST, CheckpointError
from specjax.drafter import (
    DrafterConfig,
    DrafterMismatchError,
    EagleDrafter,
    read_drafter,
    save_drafter,
)
from specjax.loaded import Drafter
from specjax.tree import TreeSpec
from tests.drafter.test_drafter import TARGET
from tests.speculative.conftest import PROMPTS


def test_taps_are_checked_and_start_at_zero_weight():
    for bad in ((1, 1), (2, 1), (-1,), (TARGET.num_layers,), [0]):
        with pytest.raises(ValueError, match="increasing target layer indices"):
            DrafterConfig(TARGET, taps=bad)
    cfg = DrafterConfig(TARGET, taps=(0, 1))
    assert cfg.tap_layers(TARGET) == (0, 1)
    with pytest.raises(DrafterMismatchError, match="reads target layer 1, the target has 1"):
        cfg.check_target(dataclasses.replace(TARGET, num_layers=1))
    dp = EagleDrafter(cfg, rngs=nnx.Rngs(0)).params()
    d = TARGET.hidden_size
    assert dp.tap_fc.shape == (2 * d, d) and not np.asarray(dp.tap_fc).any()
    rs = np.random.RandomState(0)
    hidden, taps = (jnp.asarray(rs.randn(2, 5, d), jnp.float32) for _ in range(2))
    # Zero weight: the feature is the final state, exactly (a grown drafter starts unchanged).
    np.testing.assert_array_equal(cfg.target_features(dp, hidden, (taps, 3.0 * taps)), hidden)
    # Each tap is RMS-normalised before its projection: its scale does not matter.
    w = jnp.asarray(rs.randn(2 * d, d), jnp.float32)
    dp = dataclasses.replace(dp, tap_fc=w)
    got = cfg.target_features(dp, hidden, (taps, 100.0 * taps))
    np.testing.assert_allclose(got, cfg.target_features(dp, hidden, (taps, taps)), rtol=1e-5,
                               atol=1e-4)
    unit = taps / jnp.sqrt(jnp.mean(taps ** 2, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(got, hidden + jnp.concatenate([unit, unit], -1) @ w, rtol=1e-4,
                               atol=1e-4)


def test_checkpoint_round_trip_and_refusals(tmp_path):
    cfg = DrafterConfig(TARGET, taps=(1,))
    model = EagleDrafter(cfg, rngs=nnx.Rngs(0))
    model.tap_fc[...] = jnp.ones_like(model.tap_fc[...])
    out = save_drafter(tmp_path / "d", cfg, model.params())
    got_cfg, dp, _ = read_drafter(out, TARGET)
    assert got_cfg == cfg
    np.testing.assert_array_equal(dp.tap_fc, model.tap_fc[...])
    # An untapped folder reads with no tap weights (and writes none).
    plain = save_drafter(tmp_path / "p", DrafterConfig(TARGET),
                         EagleDrafter(DrafterConfig(TARGET), rngs=nnx.Rngs(0)).params())
    manifest = json.loads((plain / MANIFEST).read_text())
    assert "taps" not in manifest["config"] and "tap_fc" not in manifest["tensors"]
    assert read_drafter(plain, TARGET)[1].tap_fc is None
    # A config that names taps its tensors lack, or taps of the wrong kind, is refused by name.
    manifest["config"]["taps"] = [1]
    (plain / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"lacks tensors \['tap_fc'\]"):
        read_drafter(plain, TARGET)
    manifest["config"]["taps"] = 1
    (plain / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="taps must be a list"):
        read_drafter(plain, TARGET)


def test_greedy_equals_vanilla_with_a_tapped_drafter(tiny_target, fitted_drafter):
    """Random tap weights make a worse drafter, never a different output; zero tap weights
    accept exactly as the untapped drafter (the loop feeds the taps where the features go)."""
    kw = dict(max_new_tokens=32, stop_on_eos=False)
    vanilla = specjax.generate(tiny_target, PROMPTS, **kw).tokens
    tree = TreeSpec("eagle2", depth=4, top_k=3, total_tokens=10)
    plain = specjax.generate(tiny_target, PROMPTS, drafter=fitted_drafter, tree=tree, **kw)
    cfg = dataclasses.replace(fitted_drafter.cfg, taps=(0, 1))
    d = tiny_target.cfg.hidden_size
    rs = np.random.RandomState(0)
    for name, w in (("zero", np.zeros((2 * d, d))), ("random", 0.3 * rs.randn(2 * d, d))):
        dp = dataclasses.replace(fitted_drafter.params, tap_fc=jnp.asarray(w, jnp.float32))
        res = specjax.generate(tiny_target, PROMPTS, drafter=Drafter(cfg=cfg, params=dp),
                               tree=tree, **kw)
        assert res.tokens == vanilla, name
        if name == "zero":
            assert res.stats["accept_lengths"] == plain.stats["accept_lengths"]
        else:
            assert res.stats["accept_lengths"] != plain.stats["accept_lengths"]
