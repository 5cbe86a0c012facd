"""The CPU rowdot kernel (C++ through XLA FFI) against its jnp reference: every remainder of
the 6-row tiles and of the output tiles (4 wide on AVX-512; 8, 6, 4, 3 or 2 wide on AVX2,
by the number of rows), a row's bits at every M, the AVX2 build run on an AVX-512 host,
leading batch axes, many calls in one program (the pool deadlock this kernel's work sharing
avoids), the argument checks and the dispatch (the build: in test_cpu_build.py)."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels.cpu_rowdot import available, rowdot, rowdot_reference
from tests.kernels.avx2_build import run_on_the_avx2_build

OK, WHY = available()
needs_kernel = pytest.mark.skipif(not OK, reason=f"CPU rowdot unavailable: {WHY}")


def _xw(m: int, n: int, k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((n, k), np.float32) / np.sqrt(k)
    return jnp.asarray(x), jnp.asarray(w)


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@needs_kernel
# Every tile height (1..6 rows), and one to four full tiles with every remainder.
@pytest.mark.parametrize("m", [*range(1, 15), 17, 24, 25])
@pytest.mark.parametrize("n,k", [(1, 16), (7, 32), (1030, 576), (4099, 64)])
def test_matches_reference(m, n, k):
    x, w = _xw(m, n, k, seed=m * 31 + n)
    _close(jax.jit(rowdot)(x, w), rowdot_reference(x, w))


@needs_kernel
@pytest.mark.parametrize("n,k", [(1030, 576), (37, 1536)])
def test_a_rows_bits_do_not_depend_on_how_many_rows(n, k):
    """The kernel must put no difference between a verify step's rows and a decode step's,
    which could make greedy speculative output part from vanilla on a near tie: each row's
    products have the same bits whatever tile heights (and output tile widths) M rows are
    cut into."""
    x, w = _xw(16, n, k, seed=5)
    alone = np.concatenate([np.asarray(jax.jit(rowdot)(x[i:i + 1], w)) for i in range(16)])
    for m in range(2, 17):
        np.testing.assert_array_equal(np.asarray(jax.jit(rowdot)(x[:m], w)), alone[:m],
                                      err_msg=f"M = {m}")


@needs_kernel
def test_the_avx2_build_matches_reference(tmp_path):
    """On an AVX-512 host the kernel runs AVX-512 code; the AVX2 build (8 lanes: other tile
    widths, and its own transposing sums) is built here for Haswell, which any such host
    also runs, and checked dense and gathered at every row count, with a row's bits the
    same at every M."""
    run_on_the_avx2_build("""
import numpy as np, jax, jax.numpy as jnp
from specjax.kernels.cpu_rowdot import (rowdot, rowdot_gathered, rowdot_gathered_reference,
                                        rowdot_reference)
rng = np.random.default_rng(0)
for n, k in ((1030, 576), (37, 1536), (7, 32)):
    x = jnp.asarray(rng.standard_normal((16, k), np.float32))
    w = jnp.asarray(rng.standard_normal((n, k), np.float32) / np.sqrt(k))
    idx = jnp.asarray(rng.integers(-2, n + 2, (1, 300)), jnp.int32)
    alone = np.concatenate([np.asarray(rowdot(x[i:i + 1], w)) for i in range(16)])
    for m in range(1, 17):
        got = np.asarray(jax.jit(rowdot)(x[:m], w))
        np.testing.assert_allclose(got, rowdot_reference(x[:m], w), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got, alone[:m], err_msg=f"M = {m}")
        np.testing.assert_allclose(rowdot_gathered(x[:m], w, idx),
                                   rowdot_gathered_reference(x[:m], w, idx),
                                   rtol=1e-5, atol=1e-5, err_msg=f"gathered, M = {m}")
print("ok")
""", tmp_path)


@needs_kernel
def test_leading_axes_and_eager():
    x, w = _xw(6, 300, 576)
    x = x.reshape(2, 3, 576)
    got = rowdot(x, w)
    assert got.shape == (2, 3, 300)
    _close(got, rowdot_reference(x, w))


@needs_kernel
def test_many_calls_in_one_program_finish():
    """40 independent products in one jit may all be scheduled on XLA's pool at once; a
    caller that waited for its queued helpers would hang here (the first version did)."""
    code = """
import jax, jax.numpy as jnp, numpy as np
from specjax.kernels.cpu_rowdot import rowdot, rowdot_reference
ws = [jnp.asarray(np.random.default_rng(i).standard_normal((1536, 576), np.float32))
      for i in range(40)]
x = jnp.ones((4, 576), jnp.float32)
got = jax.jit(lambda x, ws: [rowdot(x, w) for w in ws])(x, ws)
want = [rowdot_reference(x, w) for w in ws]
assert all(np.allclose(g, r, rtol=1e-5, atol=1e-4) for g, r in zip(got, want))
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


@needs_kernel
def test_vmap_over_weights():
    x, w = _xw(2, 40, 32)
    ws = jnp.stack([w, 2 * w])
    got = jax.vmap(rowdot, in_axes=(None, 0))(x, ws)
    _close(got, jnp.stack([rowdot_reference(x, w), 2 * rowdot_reference(x, w)]))


@pytest.mark.parametrize("x_shape,w_shape,dtype,err", [
    ((2, 24), (8, 24), jnp.float32, "K % 16"),
    ((2, 32), (8, 16), jnp.float32, r"x \[..., K\]"),
    ((2, 32), (8, 32), jnp.bfloat16, "float32"),
])
def test_bad_arguments_are_refused(x_shape, w_shape, dtype, err):
    with pytest.raises((ValueError, TypeError), match=err):
        rowdot(jnp.ones(x_shape, dtype), jnp.ones(w_shape, dtype))


@needs_kernel
def test_gradient_matches_reference():
    x, w = _xw(3, 50, 32)

    def loss(f):
        return lambda x, w: jnp.sum(jnp.sin(f(x, w)))

    for a, b in zip(jax.grad(loss(rowdot), (0, 1))(x, w),
                    jax.grad(loss(rowdot_reference), (0, 1))(x, w), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@needs_kernel
def test_head_product_dispatch(monkeypatch):
    from specjax.kernels.cpu_rowdot import head_product, use_rowdot

    x, w = _xw(4, 100, 32)
    assert use_rowdot(x, w)
    assert use_rowdot(x[:1], w)  # one row too (a vanilla step's head)
    assert not use_rowdot(jnp.ones((17, 32)), w)  # many rows: XLA's GEMM
    assert not use_rowdot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    monkeypatch.setenv("SPECJAX_CPU_ROWDOT", "off")
    assert not use_rowdot(x, w)
    _close(head_product(x, w), rowdot_reference(x, w))
