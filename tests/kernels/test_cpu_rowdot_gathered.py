"""The CPU rowdot kernel's gathered product (``x @ w_t[idx].T``, the gather fused) against its
jnp reference: one shortlist for every row and one per row, every tile remainder, padding
ids (exactly 0, even against an infinite hidden value), duplicates, the argument checks,
and the gathered-GEMM and DynaSpec dispatch that route to it on a CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels.cpu_rowdot import available, rowdot_gathered, rowdot_gathered_reference
from specjax.kernels.gathered_gemm import (
    gathered_matmul,
    gathered_matmul_ref,
    shared_gathered_matmul,
)

OK, WHY = available()
needs_kernel = pytest.mark.skipif(not OK, reason=f"CPU rowdot unavailable: {WHY}")


def _operands(m: int, n: int, k: int, rows: int, c: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32))
    w = jnp.asarray(rng.standard_normal((n, k), np.float32) / np.sqrt(k))
    idx = rng.integers(-3, n + 3, (rows, c)).astype(np.int32)  # padding on both sides
    return x, w, jnp.asarray(idx)


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 7, 13])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("n,k,c", [(50, 16, 1), (300, 64, 37), (5000, 576, 1030)])
def test_matches_reference(m, shared, n, k, c):
    x, w, idx = _operands(m, n, k, 1 if shared else m, c, seed=m * 7 + c)
    got = jax.jit(rowdot_gathered)(x, w, idx)
    assert got.shape == (m, c)
    _close(got, rowdot_gathered_reference(x, w, idx))
    pad = (np.asarray(idx) < 0) | (np.asarray(idx) >= n)
    assert (np.asarray(got)[np.broadcast_to(pad, got.shape)] == 0).all()


@needs_kernel
def test_padding_is_exactly_zero_and_duplicates_repeat():
    x, w, _ = _operands(3, 40, 32, 1, 1)
    x = x.at[1, 5].set(jnp.inf)  # 0 * inf would be NaN if a padding row were multiplied
    idx = jnp.asarray([[7, -1, 7, 40, 2**30, 0]], jnp.int32)
    got = np.asarray(rowdot_gathered(x, w, idx))
    assert (got[:, [1, 3, 4]] == 0).all()
    np.testing.assert_array_equal(got[:, 0], got[:, 2])
    rows = np.asarray([0, 2])  # the rows without the infinity
    _close(got[rows], np.asarray(rowdot_gathered_reference(x, w, idx))[rows])


@needs_kernel
def test_bad_arguments_are_refused():
    x, w, idx = _operands(2, 30, 32, 2, 5)
    with pytest.raises(ValueError, match=r"idx \[1 or M, C\]"):
        rowdot_gathered(x, w, jnp.zeros((3, 5), jnp.int32))
    with pytest.raises(TypeError, match="int32"):
        rowdot_gathered(x, w, idx.astype(jnp.int16))
    with pytest.raises(TypeError, match="float32"):
        rowdot_gathered(x.astype(jnp.bfloat16), w, idx)
    with pytest.raises(ValueError, match="K % 16"):
        rowdot_gathered(jnp.ones((2, 24)), jnp.ones((30, 24)), idx)


@needs_kernel
def test_gathered_matmul_takes_the_kernel_on_cpu_and_agrees(monkeypatch):
    x, w, idx = _operands(4, 700, 64, 4, 200)
    want = gathered_matmul_ref(x, w, idx)
    lowered = jax.jit(lambda *a: gathered_matmul(*a)).lower(x, w, idx).as_text()
    assert "specjax_cpu_rowdot_gathered" in lowered
    _close(gathered_matmul(x, w, idx), want)
    _close(gathered_matmul(x, w, idx.astype(jnp.int16), impl="rowdot"), want)  # ids cast
    monkeypatch.setenv("SPECJAX_CPU_ROWDOT", "off")
    off = jax.jit(lambda *a: gathered_matmul(*a)).lower(x, w, idx).as_text()
    assert "specjax_cpu_rowdot_gathered" not in off
    _close(gathered_matmul(x, w, idx), want)


@needs_kernel
def test_shared_gathered_matmul_both_paths(monkeypatch):
    rng = np.random.default_rng(3)
    h = jnp.asarray(rng.standard_normal((2, 4, 64), np.float32))
    w = jnp.asarray(rng.standard_normal((500, 64), np.float32))
    idx = jnp.asarray(rng.integers(-2, 502, (2, 90)).astype(np.int32))
    want = jnp.stack([gathered_matmul_ref(h[b], w, jnp.broadcast_to(idx[b], (4, 90)))
                      for b in range(2)])
    _close(shared_gathered_matmul(h, w, idx), want)
    monkeypatch.setenv("SPECJAX_CPU_ROWDOT", "off")
    _close(shared_gathered_matmul(h, w, idx), want)


@needs_kernel
def test_gradient_goes_through_the_reference():
    x, w, idx = _operands(3, 60, 32, 1, 20)

    def loss(f):
        return lambda x, w: jnp.sum(jnp.sin(f(x, w, idx)))

    for a, b in zip(jax.grad(loss(rowdot_gathered), (0, 1))(x, w),
                    jax.grad(loss(rowdot_gathered_reference), (0, 1))(x, w), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
