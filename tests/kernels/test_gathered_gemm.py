"""The gathered-column GEMM: Pallas (interpret mode) and XLA against the jnp reference, the
CUDA lowering of the real kernel on this CPU-only jaxlib, and the dispatcher's checks."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.compat import lower_for_cuda
from specjax.kernels.gathered_gemm import (
    _xla_chunk,
    gathered_matmul,
    gathered_matmul_pallas,
    gathered_matmul_ref,
    gathered_matmul_xla,
)
from tests.kernels.pallas_case import PallasCase


def _problem(n: int, c: int, vocab: int, d: int, dtype, seed: int = 0):
    """Random h [n, d], w [vocab, d] and idx [n, c] with duplicates and padding ids.

    Ids are drawn from [-2, vocab + 2), so some are out of range on both sides; column 1
    repeats column 0, and columns 2 and 3 are the padding ids -1 and vocab.
    """
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((n, d)), dtype)
    w = jnp.asarray(rng.standard_normal((vocab, d)), dtype)
    idx = rng.integers(-2, vocab + 2, (n, c))
    idx[:, 1] = idx[:, 0]
    idx[:, 2], idx[:, 3] = -1, vocab
    return h, w, jnp.asarray(idx, jnp.int32)


def _check(out, h, w, idx) -> None:
    ref = np.asarray(gathered_matmul_ref(h, w, idx))
    out = np.asarray(out)
    assert out.shape == idx.shape and out.dtype == np.float32
    idx = np.asarray(idx)
    pad = (idx < 0) | (idx >= w.shape[0])
    assert pad.any() and (out[pad] == 0.0).all() and (ref[pad] == 0.0).all()
    np.testing.assert_array_equal(out[:, 1], out[:, 0])  # duplicates
    # Inputs are exact in float32 and accumulation is float32: only summation order differs.
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)


def test_reference_is_the_dense_product():
    h, w, idx = _problem(2, 40, 64, 24, jnp.float32)
    full = np.asarray(h, np.float64) @ np.asarray(w, np.float64).T
    ids = np.asarray(idx)
    valid = (ids >= 0) & (ids < 64)
    want = np.where(valid, np.take_along_axis(full, np.where(valid, ids, 0), 1), 0.0)
    np.testing.assert_allclose(np.asarray(gathered_matmul_ref(h, w, idx)), want, rtol=1e-5,
                               atol=1e-5)


# (n, c, vocab, d, block_c, block_d, dtype): ragged C and d tails, blocks larger than the
# problem (clamped), d=576 (SmolLM2) with an exact and a ragged block_d.
PALLAS_CASES = [
    (2, 100, 300, 80, 32, 32, jnp.float32),
    (3, 37, 50, 48, 16, 64, jnp.bfloat16),
    (1, 200, 1000, 576, 64, 64, jnp.float32),
    (2, 70, 500, 576, 32, 128, jnp.bfloat16),
    (1, 8, 20, 16, 128, 64, jnp.float32),
]


class TestGatheredGemm(PallasCase):
    """The Pallas kernel against the reference, compiled (needs a GPU); the subclass below
    runs the same cases in interpret mode, as jax's own ``gpu_ops_test`` does."""

    KERNEL = staticmethod(gathered_matmul_pallas)

    @pytest.mark.parametrize("n,c,vocab,d,block_c,block_d,dtype", PALLAS_CASES)
    def test_matches_reference(self, n, c, vocab, d, block_c, block_d, dtype):
        h, w, idx = _problem(n, c, vocab, d, dtype, seed=c)
        _check(self.pallas(h, w, idx, block_c=block_c, block_d=block_d), h, w, idx)

    def test_mixed_dtypes(self):
        """bfloat16 hidden states against a float32 table, the default blocks."""
        h, w, idx = _problem(2, 130, 400, 96, jnp.float32, seed=7)
        h = h.astype(jnp.bfloat16)
        _check(self.pallas(h, w, idx), h, w, idx)


class TestGatheredGemmInterpret(TestGatheredGemm):
    """The same cases in the Pallas interpreter, on any backend."""

    INTERPRET = True


@pytest.mark.parametrize("n,c,d,dtype", [
    (1, 300, 576, jnp.float32), (4, 1000, 80, jnp.float32), (16, 300, 576, jnp.float32),
    (3, 50, 48, jnp.bfloat16), (1, 5, 8, jnp.bfloat16),
])
def test_xla_matches_reference(n, c, d, dtype):
    h, w, idx = _problem(n, c, 1000, d, dtype, seed=n)
    _check(gathered_matmul_xla(h, w, idx), h, w, idx)


def test_xla_chunked_path_is_covered():
    # [16, 300] at d=576 fp32 exceeds the gather budget: chunks of 128 candidates, the last
    # padded with -1 (the case in test_xla_matches_reference).
    assert _xla_chunk(16, 300, 576, 4) == 128
    assert _xla_chunk(1, 200, 576, 4) == 200


S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("n,c,vocab,d,dtype", [
    (4, 12288, 49152, 576, jnp.float32),  # SmolLM2's head, a 12k shortlist
    (4, 12288, 49152, 576, jnp.bfloat16),
    (1, 1000, 4096, 80, jnp.float32),  # ragged C and d
])
def test_pallas_lowers_for_cuda(n, c, vocab, d, dtype):
    f = partial(gathered_matmul_pallas, interpret=False)
    lowered = lower_for_cuda(f, S((n, d), dtype), S((vocab, d), dtype),
                             S((n, c), jnp.int32))
    assert "triton" in lowered.as_text()


def test_dispatcher_lowers_non_int32_ids_for_cuda():
    f = partial(gathered_matmul, impl="pallas")
    lowered = lower_for_cuda(f, S((2, 64), jnp.float32), S((512, 64), jnp.float32),
                             S((2, 100), jnp.int16))
    assert "triton" in lowered.as_text()


def test_dispatcher_impls_agree():
    h, w, idx = _problem(2, 60, 200, 40, jnp.float32)
    want = np.asarray(gathered_matmul(h, w, idx, impl="ref"))
    for impl in ("auto", "xla"):  # "auto" is the rowdot kernel on this CPU where it is built
        np.testing.assert_allclose(np.asarray(gathered_matmul(h, w, idx, impl=impl)), want,
                                   rtol=1e-5, atol=1e-4)


def test_block_sizes_must_be_powers_of_two():
    h, w, idx = _problem(1, 16, 32, 16, jnp.float32)
    with pytest.raises(ValueError, match="block_c must be a positive power of two"):
        gathered_matmul_pallas(h, w, idx, block_c=48, interpret=True)
    with pytest.raises(ValueError, match="block_d must be a positive power of two"):
        gathered_matmul_pallas(h, w, idx, block_d=0, interpret=True)


@pytest.mark.parametrize("h_shape,w_shape,idx_shape,idx_dtype,impl,match", [
    ((4,), (10, 4), (1, 3), jnp.int32, "xla", "ranks h 1"),
    ((1, 4), (10, 4), (3,), jnp.int32, "xla", "idx 1"),
    ((1, 4), (10, 5), (1, 3), jnp.int32, "xla", "d=4, w has d=5"),
    ((2, 4), (10, 4), (1, 3), jnp.int32, "xla", "idx has 1 rows but h has 2"),
    ((1, 4), (10, 4), (1, 3), jnp.float32, "xla", "idx must be integer"),
    ((1, 4), (10, 4), (1, 3), jnp.int32, "cuda", "unknown impl 'cuda'"),
])
def test_dispatcher_errors(h_shape, w_shape, idx_shape, idx_dtype, impl, match):
    h, w = jnp.ones(h_shape, jnp.float32), jnp.ones(w_shape, jnp.float32)
    with pytest.raises(ValueError, match=match):
        gathered_matmul(h, w, jnp.zeros(idx_shape, idx_dtype), impl=impl)


def test_dispatcher_rejects_integer_weights():
    with pytest.raises(ValueError, match="w must be floating point"):
        gathered_matmul(jnp.ones((1, 4)), jnp.ones((10, 4), jnp.int32),
                        jnp.zeros((1, 3), jnp.int32))
