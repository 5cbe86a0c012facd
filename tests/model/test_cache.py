"""The KV cache: incremental decoding equals a full forward pass."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.model import cache_mask, forward, init_cache


@pytest.fixture(scope="module")
def target(tiny_llama, tmp_path_factory):
    return specjax.load(specjax.convert(tiny_llama, tmp_path_factory.mktemp("t") / "sj",
                                        progress=False))


def test_incremental_equals_full_forward(target):
    cfg, params = target.cfg, target.params
    toks = jnp.asarray(np.random.RandomState(1).randint(0, 256, (2, 20)))
    pos = jnp.broadcast_to(jnp.arange(20), (2, 20))
    full, _ = forward(params, cfg, toks, pos, init_cache(cfg, 2, 32))

    # 8-token prefill, then chunks of 1, 3 and 8 through the cache.
    cache = init_cache(cfg, 2, 32)
    pieces, start = [], 0
    for size in (8, 1, 3, 8):
        logits, cache = forward(params, cfg, toks[:, start:start + size],
                                pos[:, start:start + size], cache)
        cache = dataclasses.replace(cache, lengths=cache.lengths + size)
        pieces.append(np.asarray(logits))
        start += size
    np.testing.assert_allclose(np.concatenate(pieces, 1), np.asarray(full), atol=1e-4, rtol=0)


def test_rows_past_length_are_invisible(target):
    """Garbage beyond lengths[b] (padding, rejected drafts) must not change the output."""
    cfg, params = target.cfg, target.params
    toks = jnp.asarray(np.random.RandomState(2).randint(0, 256, (1, 6)))
    pos = jnp.arange(6)[None]
    cache = init_cache(cfg, 1, 16)
    clean, _ = forward(params, cfg, toks, pos, cache)
    dirty = dataclasses.replace(cache, k=tuple(k.at[:, 6:].set(9.0) for k in cache.k),
                                v=tuple(v.at[:, 6:].set(-9.0) for v in cache.v))
    noisy, _ = forward(params, cfg, toks, pos, dirty)
    np.testing.assert_array_equal(np.asarray(noisy), np.asarray(clean))


def test_per_row_lengths(target):
    """Rows of a batch at different lengths equal each row run alone."""
    cfg, params = target.cfg, target.params
    rs = np.random.RandomState(3)
    a, b = rs.randint(0, 256, 5), rs.randint(0, 256, 9)
    singles = []
    for seq in (a, b):
        cache = init_cache(cfg, 1, 16)
        _, cache = forward(params, cfg, jnp.asarray(seq[None, :-1]),
                           jnp.arange(len(seq) - 1)[None], cache)
        cache = dataclasses.replace(cache, lengths=cache.lengths + len(seq) - 1)
        logits, _ = forward(params, cfg, jnp.asarray(seq[None, -1:]),
                            jnp.asarray([[len(seq) - 1]]), cache)
        singles.append(np.asarray(logits[0, 0]))
    prompt = np.zeros((2, 8), np.int32)
    prompt[0, :4], prompt[1, :8] = a[:-1], b[:-1]
    cache = init_cache(cfg, 2, 16)
    _, cache = forward(params, cfg, jnp.asarray(prompt), jnp.broadcast_to(jnp.arange(8), (2, 8)),
                       cache)
    cache = dataclasses.replace(cache, lengths=jnp.asarray([4, 8], jnp.int32))
    logits, _ = forward(params, cfg, jnp.asarray([[a[-1]], [b[-1]]]), jnp.asarray([[4], [8]]),
                        cache)
    np.testing.assert_allclose(np.asarray(logits[:, 0]), np.stack(singles), atol=1e-4, rtol=0)


def test_cache_mask_prefix_and_block():
    lengths = jnp.asarray([2, 0])
    block = jnp.asarray([[[1, 0], [1, 1]], [[1, 0], [0, 1]]], bool)  # causal; two roots
    m = np.asarray(cache_mask(lengths, block, capacity=5))
    np.testing.assert_array_equal(m[0], [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    np.testing.assert_array_equal(m[1], [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0]])


def test_bfloat16_tracks_float32(target):
    cfg = target.cfg
    toks = jnp.asarray(np.random.RandomState(4).randint(0, 256, (1, 16)))
    pos = jnp.arange(16)[None]
    ref, _ = forward(target.params, cfg, toks, pos, init_cache(cfg, 1, 16))
    bf = specjax.load(target.path, dtype="bfloat16")
    assert bf.params.embed.dtype == jnp.bfloat16
    got, cache = forward(bf.params, cfg, toks, pos, init_cache(cfg, 1, 16, jnp.bfloat16))
    assert got.dtype == jnp.float32 and cache.k[0].dtype == jnp.bfloat16
    ref, got = np.asarray(ref), np.asarray(got)
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.8
