"""The fused inference layout (Q/K/V and gate/up as one product each) computes what the
stored layout does, reads back the stored matrices, and saves as the stored layout."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from specjax.checkpoint import flatten_params
from specjax.model import (
    FusedLayerParams,
    LayerParams,
    forward,
    fuse_params,
    init_cache,
    unfuse_params,
)


def test_load_fuses_and_forward_agrees(tiny_target):
    fused = tiny_target.params
    assert all(isinstance(lp, FusedLayerParams) for lp in fused.layers)
    plain = unfuse_params(fused)
    assert all(isinstance(lp, LayerParams) for lp in plain.layers)
    cfg = tiny_target.cfg
    toks = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 7)))
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    a, ca = forward(fused, cfg, toks, pos, init_cache(cfg, 2, 16))
    b, cb = forward(plain, cfg, toks, pos, init_cache(cfg, 2, 16))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ca.k[0]), np.asarray(cb.k[0]), atol=1e-6, rtol=0)


def test_round_trip_and_views(tiny_target):
    fused = tiny_target.params
    plain = unfuse_params(fused)
    again = fuse_params(plain)
    assert fuse_params(again) is not None and isinstance(again.layers[0], FusedLayerParams)
    for f in dataclasses.fields(LayerParams):
        x, y = getattr(fused.layers[1], f.name), getattr(plain.layers[1], f.name)
        assert (x is None) == (y is None), f.name
        if x is not None:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f.name)
    flat_f, flat_p = flatten_params(fused), flatten_params(plain)
    assert sorted(flat_f) == sorted(flat_p) and "layers.1.wq" in flat_f
