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
    fused = fuse_params(unfuse_params(tiny_target.params))  # [in, out], whatever load chose
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


def test_out_major_layout_agrees_at_every_row_count(tiny_target):
    """The CPU rowdot layout ([out, in] products) against the stored layout: T=1 and T=5 go
    through the kernel (where it is built), T=40 through XLA's dot on the transposed
    weights; unfusing reads back the stored matrices."""
    from specjax.kernels.cpu_rowdot import available
    from specjax.model import to_out_major

    cfg = tiny_target.cfg
    plain = unfuse_params(tiny_target.params)
    om = to_out_major(plain)
    assert all(lp.out_major for lp in om.layers) and to_out_major(om) is not None
    lp, ref = om.layers[1], plain.layers[1]
    assert lp.wqkv.shape == (ref.wq.shape[1] + 2 * ref.wk.shape[1], ref.wq.shape[0])
    back = unfuse_params(om)
    for f in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        np.testing.assert_array_equal(np.asarray(getattr(back.layers[1], f)),
                                      np.asarray(getattr(ref, f)), err_msg=f)
        np.testing.assert_array_equal(np.asarray(getattr(lp, f)) if f not in ("wo", "w_down")
                                      else np.asarray(lp.wo.T if f == "wo" else lp.w_down.T),
                                      np.asarray(getattr(ref, f)), err_msg=f)
    rng = np.random.RandomState(1)
    for t in (1, 5, 40):
        toks = jnp.asarray(rng.randint(0, cfg.vocab_size, (2, t)))
        pos = jnp.broadcast_to(jnp.arange(t), (2, t))
        a, _ = forward(om, cfg, toks, pos, init_cache(cfg, 2, 48))
        b, _ = forward(plain, cfg, toks, pos, init_cache(cfg, 2, 48))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=0,
                                   err_msg=f"T={t}, kernel built: {available()}")
