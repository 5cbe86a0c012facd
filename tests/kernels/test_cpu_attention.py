"""The CPU cache-attention kernel (C++ through XLA FFI) against its reference, the model's dense
masked softmax: ragged prefixes, tree masks wider than the queries (a drafter's frontier over
its workspace), blocks that run past the cache, queries that see nothing, every GQA grouping
and query-chunk remainder, the gradient, the argument checks, many calls in one program, and
the model's dispatch (the same logits with the kernel off)."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.kernels.cpu_attention import (
    MAX_QUERIES,
    cache_attention,
    cache_attention_reference,
    use_cpu_attention,
)
from specjax.kernels.cpu_build import available, cpu_isa
from tests.kernels.avx2_build import run_on_the_avx2_build

OK, WHY = available()
needs_kernel = pytest.mark.skipif(not OK, reason=f"CPU kernels unavailable: {WHY}")


def _case(b, t, r, h, hkv, dh, s, lengths, seed=0, p_visible=0.6):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, h, dh), np.float32))
    k = jnp.asarray(rng.standard_normal((b, s, hkv, dh), np.float32))
    v = jnp.asarray(rng.standard_normal((b, s, hkv, dh), np.float32))
    mask = jnp.asarray(rng.random((b, t, r)) < p_visible)
    return q, k, v, jnp.asarray(lengths, jnp.int32), mask


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


_attend = jax.jit(cache_attention, static_argnums=(5, 6, 7))


@needs_kernel
@pytest.mark.parametrize("scores", ["auto", "dots", "lanes"])
@pytest.mark.parametrize("b,t,r,h,hkv,dh,s,lengths", [
    (1, 1, 1, 9, 3, 64, 50, [20]),          # a decode step (SmolLM2's heads)
    (1, 4, 4, 9, 3, 64, 300, [290]),        # a verify step
    (2, 5, 5, 9, 3, 64, 40, [0, 38]),       # ragged; row 1's block runs past the cache
    (2, 3, 11, 9, 3, 64, 60, [7, 30]),      # a frontier of 3 over an 11-row workspace
    (1, 16, 16, 15, 5, 64, 200, [100]),     # 48 queries a KV head: chunks of 12
    (3, 7, 7, 8, 8, 32, 30, [30, 5, 0]),    # MHA (G = 1), Dh = 32; row 0 sees no block row
    (1, 5, 5, 4, 1, 128, 70, [33]),         # MQA, Dh = 128 (two slabs of V)
    (1, 2, 2, 6, 2, 80, 20, [10]),          # Dh = 80: a slab remainder
    (1, MAX_QUERIES, MAX_QUERIES, 9, 3, 64, 130, [60]),
])
def test_matches_reference(scores, b, t, r, h, hkv, dh, s, lengths):
    """Both score layouts on every shape: dots (a query's dot products summed across the
    vector) and lanes (one query a lane; a KV head's queries in groups of up to 16, the
    last lanes empty where fewer)."""
    q, k, v, lens, mask = _case(b, t, r, h, hkv, dh, s, lengths, seed=t * 7 + s)
    _close(_attend(q, k, v, lens, mask, dh ** -0.5, 0, scores), cache_attention_reference(
        q, k, v, lens, mask, dh ** -0.5))


@needs_kernel
@pytest.mark.parametrize("scores", ["dots", "lanes"])
@pytest.mark.parametrize("splits", [0, 1, 2, 3, 5, 16])  # 0: the kernel chooses
@pytest.mark.parametrize("b,t,r,h,hkv,dh,s,lengths", [
    (1, 1, 1, 9, 3, 64, 900, [800]),        # a decode step over a long prefix
    (2, 4, 4, 9, 3, 64, 300, [290, 0]),     # ragged; row 1 sees only its block
    (1, 12, 12, 9, 3, 64, 520, [500]),      # a tree past the last range's start
    (1, 3, 9, 4, 1, 128, 70, [3]),          # more ranges than vectors of rows: some empty
])
def test_split_rows_match_reference(splits, scores, b, t, r, h, hkv, dh, s, lengths):
    """Cutting each query group's rows into ranges (on cores of their own, then combined by
    their maxima and sums of exps) changes only summation order: every range count, ranges
    that show a query nothing, and ranges with no rows at all."""
    q, k, v, lens, mask = _case(b, t, r, h, hkv, dh, s, lengths, seed=splits + s)
    want = cache_attention_reference(q, k, v, lens, mask, dh ** -0.5)
    _close(_attend(q, k, v, lens, mask, dh ** -0.5, splits, scores), want)


@needs_kernel
@pytest.mark.parametrize("scores", ["dots", "lanes"])
def test_split_rows_for_a_query_that_sees_nothing(scores):
    q, k, v, lens, mask = _case(2, 3, 3, 4, 2, 32, 300, [0, 280])
    mask = mask.at[0].set(False)
    got = _attend(q, k, v, lens, mask, 0.2, 4, scores)
    _close(got, cache_attention_reference(q, k, v, lens, mask, 0.2))
    _close(got[0, 0, 0], jnp.mean(v[0, :, 0], axis=0))


@needs_kernel
@pytest.mark.parametrize("scores", ["dots", "lanes"])
def test_a_query_that_sees_nothing_gets_what_the_dense_softmax_gives(scores):
    """No prefix and an empty mask row: the dense softmax's finite fill averages all S rows;
    the kernel answers the same (never NaN)."""
    q, k, v, lens, mask = _case(2, 3, 3, 4, 2, 32, 9, [0, 0])
    mask = mask.at[0, 1].set(False).at[1].set(False)
    got = _attend(q, k, v, lens, mask, 0.2, 0, scores)
    assert np.isfinite(np.asarray(got)).all()
    _close(got, cache_attention_reference(q, k, v, lens, mask, 0.2))
    _close(got[1, 0, 0], jnp.mean(v[1, :, 0], axis=0))


@needs_kernel
@pytest.mark.parametrize("t,g", [(1, 3), (2, 3), (3, 3), (4, 3), (5, 3), (6, 3), (9, 3),
                                 (12, 3), (8, 1), (2, 4), (3, 4)])
def test_auto_takes_lanes_where_the_groups_fill_three_quarters(t, g):
    """The kernel's choice, seen through summation order: "auto" is bit for bit "lanes"
    where a KV head's T * G queries, cut into as few groups of up to a vector as they fit
    and as even as they fit, fill at least 3/4 of the lanes (on AVX-512: 12, 15, 27 or 36
    queries, not 9 or 18), and "dots" elsewhere."""
    lanes = 16 if cpu_isa() == "avx512f" else 8
    queries = t * g
    groups = -(-queries // lanes)
    takes_lanes = 4 * -(-queries // groups) >= 3 * lanes
    q, k, v, lens, mask = _case(1, t, t, 2 * g, 2, 64, 300, [290], seed=t + g)
    got = {layout: np.asarray(_attend(q, k, v, lens, mask, 0.125, 1, layout))
           for layout in ("auto", "dots", "lanes")}
    assert not np.array_equal(got["dots"], got["lanes"])  # else the test could not tell
    np.testing.assert_array_equal(got["auto"], got["lanes" if takes_lanes else "dots"])


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), t=st.integers(1, 9), extra=st.integers(0, 5),
       hkv=st.integers(1, 3), g=st.integers(1, 4), s=st.integers(1, 48),
       splits=st.sampled_from([0, 0, 1, 2, 7]), scores=st.sampled_from(["auto", "dots", "lanes"]),
       seed=st.integers(0, 2**16), data=st.data())
def test_random_shapes_and_masks(b, t, extra, hkv, g, s, splits, scores, seed, data):
    lengths = data.draw(st.lists(st.integers(0, s + 2), min_size=b, max_size=b))
    q, k, v, lens, mask = _case(b, t, t + extra, hkv * g, hkv, 16, s, lengths, seed=seed,
                                p_visible=data.draw(st.sampled_from([0.0, 0.3, 1.0])))
    _close(cache_attention(q, k, v, lens, mask, 0.25, splits, scores),
           cache_attention_reference(q, k, v, lens, mask, 0.25))


@needs_kernel
def test_gradient_matches_reference():
    q, k, v, lens, mask = _case(2, 3, 4, 6, 2, 32, 12, [5, 0])

    def loss(f):
        return lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, lens, mask, 0.3)))

    for a, b in zip(jax.grad(loss(cache_attention), (0, 1, 2))(q, k, v),
                    jax.grad(loss(cache_attention_reference), (0, 1, 2))(q, k, v), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@needs_kernel
def test_vmap_over_batches_of_caches():
    q, k, v, lens, mask = _case(1, 2, 2, 4, 2, 16, 10, [4])
    got = jax.vmap(cache_attention, in_axes=(None, 0, 0, None, None, None))(
        q, jnp.stack([k, 2 * k]), jnp.stack([v, -v]), lens, mask, 0.5)
    _close(got[1], cache_attention_reference(q, 2 * k, -v, lens, mask, 0.5))


@needs_kernel
def test_many_calls_in_one_program_finish():
    """Thirty layers' attentions in one jit may all be on XLA's pool at once; the work sharing
    must never wait for a helper that has not started (cpu_pool.h)."""
    code = """
import jax, jax.numpy as jnp, numpy as np
from specjax.kernels.cpu_attention import cache_attention, cache_attention_reference
rng = np.random.default_rng(0)
kv = [jnp.asarray(rng.standard_normal((1, 400, 3, 64), np.float32)) for _ in range(30)]
q = jnp.asarray(rng.standard_normal((1, 4, 9, 64), np.float32))
lens, mask = jnp.array([390], jnp.int32), jnp.tril(jnp.ones((4, 4), bool))[None]
got = jax.jit(lambda q, kv: [cache_attention(q, k, k, lens, mask, 0.125) for k in kv])(q, kv)
want = [cache_attention_reference(q, k, k, lens, mask, 0.125) for k in kv]
assert all(np.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got, want))
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


@needs_kernel
def test_the_avx2_build_matches_reference(tmp_path):
    """On an AVX-512 host the kernels run AVX-512 code; the AVX2 build (8 lanes: other query
    groups, tiles and slabs) is built here for Haswell, which any such host also runs, and
    checked on random shapes in both layouts."""
    run_on_the_avx2_build("""
import numpy as np, jax.numpy as jnp
from specjax.kernels.cpu_attention import cache_attention, cache_attention_reference
rng = np.random.default_rng(0)
for case in range(15):
    b, t, hkv, g = (int(x) for x in rng.integers(1, 4, 4))
    t += int(rng.integers(0, 6))
    r, s, dh = t + int(rng.integers(0, 3)), int(rng.integers(1, 300)), [16, 64, 80][case % 3]
    q = jnp.asarray(rng.standard_normal((b, t, hkv * g, dh), np.float32))
    k, v = (jnp.asarray(rng.standard_normal((b, s, hkv, dh), np.float32)) for _ in "kv")
    lens = jnp.asarray(rng.integers(0, s + 2, b), jnp.int32)
    mask = jnp.asarray(rng.random((b, t, r)) < [0.0, 0.5, 1.0][case % 3])
    want = cache_attention_reference(q, k, v, lens, mask, 0.2)
    for scores, splits in (("dots", 1), ("lanes", 1), ("lanes", 3), ("auto", 0)):
        got = cache_attention(q, k, v, lens, mask, 0.2, splits, scores)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=str(case))
print("ok")
""", tmp_path)


@pytest.mark.parametrize("shapes,dtype,err", [
    (((1, 2, 4, 24), (1, 9, 2, 24)), jnp.float32, "Dh % 16"),
    (((1, 2, 3, 16), (1, 9, 2, 16)), jnp.float32, "H % Hkv"),
    (((1, 2, 4, 16), (2, 9, 2, 16)), jnp.float32, r"k and v \[B, S, Hkv, Dh\]"),
    (((1, 2, 4, 16), (1, 9, 2, 16)), jnp.bfloat16, "float32"),
])
def test_bad_arguments_are_refused(shapes, dtype, err):
    (qs, ks) = shapes
    with pytest.raises((ValueError, TypeError), match=err):
        cache_attention(jnp.ones(qs, dtype), jnp.ones(ks, dtype), jnp.ones(ks, dtype),
                        jnp.zeros((qs[0],), jnp.int32), jnp.ones(qs[:2] + (2,), bool), 0.1)


@pytest.mark.parametrize("splits", [-1, 17])
def test_a_split_count_out_of_range_is_refused(splits):
    q, k, v, lens, mask = _case(1, 2, 2, 4, 2, 16, 9, [3])
    with pytest.raises(ValueError, match="splits must be 0"):
        cache_attention(q, k, v, lens, mask, 0.1, splits)


def test_an_unknown_score_layout_is_refused():
    q, k, v, lens, mask = _case(1, 2, 2, 4, 2, 16, 9, [3])
    with pytest.raises(ValueError, match="scores must be one of"):
        cache_attention(q, k, v, lens, mask, 0.1, 0, "rows")


@needs_kernel
def test_dispatch(monkeypatch):
    q, k, *_ = _case(1, 4, 4, 9, 3, 64, 20, [3])
    assert use_cpu_attention(q, k)
    assert not use_cpu_attention(q, k, window=8)  # a sliding window's mask is on positions
    assert not use_cpu_attention(jnp.ones((1, MAX_QUERIES + 1, 9, 64)), k)  # prefill: XLA
    assert not use_cpu_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16))
    monkeypatch.setenv("SPECJAX_CPU_ATTENTION", "off")
    assert not use_cpu_attention(q, k)


@needs_kernel
def test_the_model_gives_the_same_logits_with_the_kernel_off(monkeypatch, tiny_target):
    """A prefill (XLA), then a tree step (the kernel) against the same step traced with
    SPECJAX_CPU_ATTENTION=off: the logits agree to float32 summation order."""
    from specjax.model import KVCache, forward, init_cache

    params, cfg = tiny_target.params, tiny_target.cfg
    cache = init_cache(cfg, 2, 48)
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 20)))
    _, cache = forward(params, cfg, prompt, jnp.broadcast_to(jnp.arange(20), (2, 20)), cache)
    cache = KVCache(k=cache.k, v=cache.v, lengths=jnp.array([20, 17], jnp.int32))
    tree = jnp.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)
    tokens = jnp.array([[5, 6, 7, 8], [9, 10, 11, 12]])
    positions = cache.lengths[:, None] + jnp.array([0, 1, 1, 2])

    def step(kernel: bool):
        # A new function each time: a cached trace would keep the first choice.
        def f(*args):
            return forward.__wrapped__(*args[:1], cfg, *args[1:])

        lowered = jax.jit(f).lower(params, tokens, positions, cache,
                                   jnp.broadcast_to(tree, (2, 4, 4)))
        assert ("specjax_cpu_cache_attention" in lowered.as_text()) == kernel
        return lowered.compile()(params, tokens, positions, cache,
                                 jnp.broadcast_to(tree, (2, 4, 4)))

    on, _ = step(kernel=True)
    monkeypatch.setenv("SPECJAX_CPU_ATTENTION", "off")
    off, _ = step(kernel=False)
    np.testing.assert_allclose(np.asarray(on), np.asarray(off), rtol=1e-4, atol=1e-4)
