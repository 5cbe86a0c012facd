"""A multi-row matrix-vector product for XLA:CPU (C++ through XLA FFI), and its reference.

``rowdot(x, w_t)`` computes ``x @ w_t.T`` for a few rows of ``x`` (a verify step's T tree
nodes) by streaming each row of ``w_t`` once for all of them: M = 2 rows cost about what one
does and M = 4 about 1.2-1.4x, where XLA's own small-M GEMM costs 1.5-2x and 2-3x
(``examples/cpu_rowdot_cost.py``; docs/benchmarks.md, issue 10); it asks for the next
weight rows ahead of their use, into L2, so memory and FMAs overlap (docs/kernels.md).
The source, ``cpu_rowdot.cc``, ships beside this file and is built on first use with the
other CPU kernels (:mod:`specjax.kernels.cpu_build`: the host's g++, AVX-512F or AVX2 with
FMA). Hosts without either get :func:`available` False and a reason, and callers keep the
XLA dot.

:func:`rowdot_gathered` is the same product over a shortlist of ``w_t``'s rows (``x @
w_t[idx].T``, the gather fused: each listed row is read once, straight from the table, and
prefetched one tile ahead since no hardware prefetcher can guess it), for the DynaSpec
head's gathered-column GEMM on the CPU (:mod:`specjax.kernels.gathered_gemm`).

Where it runs: :func:`head_product` (the target's LM head, whose [V, d] table is already the
[out, in] layout this kernel reads) sends 1..16 float32 rows to it, and
:func:`out_major_product` sends 1..16 rows of every decoder-layer product of a target that
:func:`specjax.model.to_out_major` stored [out, in] (``specjax.load`` does so on a CPU
backend for float32 weights without a mesh). Prefill's many rows stay on XLA's dot.
``SPECJAX_CPU_ROWDOT=off`` turns the kernel off (and ``load`` keeps [in, out]).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from specjax.kernels.cpu_build import available, kernels_enabled

Array = jax.Array
TARGET = "specjax_cpu_rowdot"
GATHERED_TARGET = "specjax_cpu_rowdot_gathered"


def rowdot_reference(x: Array, w_t: Array) -> Array:
    """The same product in jnp: x [..., K], w_t [N, K] -> [..., N] (fp32, HIGHEST precision)."""
    return jnp.einsum("...k,nk->...n", x, w_t, precision=jax.lax.Precision.HIGHEST)


@jax.custom_vjp
def _rowdot(x: Array, w_t: Array) -> Array:
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (w_t.shape[0],), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, w_t)


def _rowdot_fwd(x: Array, w_t: Array) -> tuple[Array, tuple[Array, Array]]:
    return _rowdot(x, w_t), (x, w_t)


def _rowdot_bwd(res: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
    # The gradient is a large-M product (or a rank-M update): XLA's own GEMMs do it well.
    x, w_t = res
    return g @ w_t, jnp.einsum("...n,...k->nk", g, x)


_rowdot.defvjp(_rowdot_fwd, _rowdot_bwd)


def rowdot(x: Array, w_t: Array) -> Array:
    """``x @ w_t.T`` on XLA:CPU for a few rows of x.

    Args:
      x: [..., K] float32; the leading axes are flattened into M rows (M small: ~1-16).
      w_t: [N, K] float32, one output feature per row; K a multiple of 16.

    Returns:
      [..., N] float32, equal to :func:`rowdot_reference` up to summation order.
    """
    _check_operands(x, w_t)
    return _rowdot(x, w_t)


def _check_operands(x: Array, w_t: Array) -> None:
    """The checks :func:`rowdot` and :func:`rowdot_gathered` share, with the kernel built."""
    if x.dtype != jnp.float32 or w_t.dtype != jnp.float32:
        raise TypeError(f"rowdot takes float32, got x {x.dtype} and w_t {w_t.dtype}")
    if w_t.ndim != 2 or x.shape[-1] != w_t.shape[1]:
        raise ValueError(f"rowdot needs x [..., K] and w_t [N, K]; got {x.shape} and "
                         f"{w_t.shape}")
    if w_t.shape[1] % 16:
        raise ValueError(f"rowdot needs K % 16 == 0 (whole SIMD vectors); K = {w_t.shape[1]}")
    ok, why = available()
    if not ok:
        raise RuntimeError(f"the CPU rowdot kernel is not available here: {why}; use "
                           "rowdot_reference (an XLA dot) instead")


def rowdot_gathered_reference(x: Array, w_t: Array, idx: Array) -> Array:
    """:func:`rowdot_gathered` in jnp: x [M, K], w_t [N, K], idx [R, C] (R = 1 or M) ->
    [M, C]; an id outside [0, N) is padding whose output is exactly 0. It is the gathered
    GEMM's specification with the shortlist broadcast to every row."""
    from specjax.kernels.gathered_gemm import gathered_matmul_ref  # it imports this module

    return gathered_matmul_ref(x, w_t, jnp.broadcast_to(idx, (x.shape[0], idx.shape[1])))


@jax.custom_vjp
def _rowdot_gathered(x: Array, w_t: Array, idx: Array) -> Array:
    out = jax.ShapeDtypeStruct((x.shape[0], idx.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(GATHERED_TARGET, out, vmap_method="sequential")(x, w_t, idx)


def _rowdot_gathered_fwd(x: Array, w_t: Array, idx: Array):
    return _rowdot_gathered(x, w_t, idx), (x, w_t, idx)


def _rowdot_gathered_bwd(res: tuple[Array, Array, Array], g: Array):
    # Inference runs this product; a gradient (none is taken today) goes through the reference.
    x, w_t, idx = res
    _, vjp = jax.vjp(lambda a, b: rowdot_gathered_reference(a, b, idx), x, w_t)
    return (*vjp(g), None)


_rowdot_gathered.defvjp(_rowdot_gathered_fwd, _rowdot_gathered_bwd)


def rowdot_gathered(x: Array, w_t: Array, idx: Array) -> Array:
    """``x @ w_t[idx].T`` on XLA:CPU, the gather fused into the kernel.

    Args:
      x: [M, K] float32 (M small, as in :func:`rowdot`).
      w_t: [N, K] float32, one output feature per row; K a multiple of 16.
      idx: [R, C] int32 row ids of ``w_t``: R = 1 (one shortlist for every row of x) or
        R = M (one per row). Duplicates are allowed; an id outside [0, N) is padding.

    Returns:
      [M, C] float32, ``out[m, c] = x[m] . w_t[idx[r, c]]`` (r = 0 or m), exactly 0 for
      padding; equal to :func:`rowdot_gathered_reference` up to summation order.
    """
    _check_operands(x, w_t)
    if x.ndim != 2 or idx.ndim != 2 or idx.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"rowdot_gathered needs x [M, K] and idx [1 or M, C]; got {x.shape} "
                         f"and {idx.shape}")
    if idx.dtype != jnp.int32:
        raise TypeError(f"rowdot_gathered takes int32 ids, got {idx.dtype}")
    return _rowdot_gathered(x, w_t, idx)


MAX_ROWS = 16  # above this the FMAs, not the weight stream, bound the kernel (it then loses)


def use_rowdot(x: Array, w_t: Array) -> bool:
    """Whether the kernel takes these operands (decided at trace time): float32,
    1..MAX_ROWS rows, K % 16 == 0, a CPU backend with one device in use (no
    active mesh), the kernel built, and ``SPECJAX_CPU_ROWDOT`` not ``off``."""
    from specjax.sharding import active_mesh

    rows = math.prod(x.shape[:-1])
    return (kernels_enabled("SPECJAX_CPU_ROWDOT") and x.dtype == jnp.float32
            and w_t.dtype == jnp.float32 and 1 <= rows <= MAX_ROWS
            and w_t.shape[1] % 16 == 0 and jax.default_backend() == "cpu"
            and active_mesh() is None and available()[0])


def head_product(x: Array, w_t: Array) -> Array:
    """``x @ w_t.T`` in fp32 ([..., K] x [N, K] -> [..., N]) through the kernel where
    :func:`use_rowdot` says it pays (one row too: a SmolLM2 T = 1 forward is 4% faster with
    the LM head on the kernel than on XLA's matrix-vector path), else XLA's dot."""
    if use_rowdot(x, w_t):
        return rowdot(x, w_t)
    return jnp.einsum("...d,vd->...v", x, w_t, preferred_element_type=jnp.float32)


def out_major_product(x: Array, w_t: Array) -> Array:
    """A decoder layer's product with its weight stored [out, in]
    (:func:`specjax.model.to_out_major`): the kernel for 1..16 rows (one row too: XLA's dot
    on this layout is slower than on [in, out]), XLA's dot for more (prefill)."""
    if use_rowdot(x, w_t):
        return rowdot(x, w_t)
    return jnp.einsum("...k,nk->...n", x, w_t)
