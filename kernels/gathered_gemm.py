"""Gathered-column GEMM: logits over a per-row shortlist, ``h · W[:, idx]`` with the gather fused.

The weight is stored ``[V, d]`` (the LM head / tied embedding layout of
:class:`specjax.model.Params`), so the column ``W[:, v]`` of the maths is the contiguous row
``w[v]`` here, and gathering a shortlist gathers whole rows.

Shapes, for every implementation:

* ``h``: ``[N, d]`` hidden states (float32 or bfloat16);
* ``w``: ``[V, d]``;
* ``idx``: ``[N, C]`` integer candidate ids, one list per row of ``h``; duplicates are
  allowed, and an id outside ``[0, V)`` is padding whose logit is exactly 0.0;
* result: ``[N, C]`` float32, ``out[n, c] = sum_k h[n, k] * w[idx[n, c], k]``.

Implementations: :func:`gathered_matmul_ref` (plain jnp, the specification),
:func:`gathered_matmul_xla` (XLA, any backend), :func:`gathered_matmul_pallas` (a Pallas
kernel with the Triton lowering, the default on a GPU) and the CPU rowdot kernel's gathered
product (:func:`specjax.kernels.cpu_rowdot.rowdot_gathered`, the default on a CPU where it is
built, for float32 operands). :func:`gathered_matmul` validates and dispatches;
:func:`shared_gathered_matmul` is the product with one shortlist for several rows of ``h``.
The Pallas backend lives in this module alone, so moving it from Triton to Mosaic GPU touches
nothing else.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl

from specjax.compat import pallas_gpu_available, pltriton, triton_params
from specjax.kernels.cpu_rowdot import rowdot_gathered, use_rowdot

Impl = Literal["auto", "xla", "pallas", "rowdot", "ref"]

# The XLA path gathers at most this many bytes of W rows at a time, so the gathered block
# stays in a core's L2 (2 MiB on the dev machines) between the gather and the matvec. One
# whole [N, C, d] gather (75 MB at N=4, C=8192, d=576) measured 3-5x slower on CPU.
_XLA_CHUNK_BYTES = 2**20


def _in_range(idx: Array, vocab_size: int) -> Array:
    """Mask of the ids that are real vocabulary entries (the rest are padding)."""
    return (idx >= 0) & (idx < vocab_size)


def gathered_matmul_ref(h: Array, w: Array, idx: Array) -> Array:
    """Plain-jnp reference. h: [N, d], w: [V, d], idx: [N, C] -> [N, C] float32.

    Gathers ``w[idx]`` as an [N, C, d] array and contracts in float32 at full precision;
    out-of-range ids give 0.0.
    """
    valid = _in_range(idx, w.shape[0])
    rows = jnp.take(w, jnp.where(valid, idx, 0), axis=0).astype(jnp.float32)  # [N, C, d]
    logits = jnp.einsum("nd,ncd->nc", h.astype(jnp.float32), rows,
                        precision=lax.Precision.HIGHEST)
    return jnp.where(valid, logits, 0.0)


def _xla_chunk(n: int, c: int, d: int, itemsize: int) -> int:
    """Candidates per row gathered at once: the largest power of two within the byte budget
    (at least 128), or all ``c`` when they fit."""
    per_candidate = max(1, n * d * itemsize)
    chunk = max(128, 1 << max(0, (_XLA_CHUNK_BYTES // per_candidate).bit_length() - 1))
    return c if c <= chunk else chunk


@jax.jit
def gathered_matmul_xla(h: Array, w: Array, idx: Array) -> Array:
    """XLA path: clipped row gather + float32 batched matvec, masked. Shapes as the reference.

    For C beyond the chunk budget, ``idx`` is padded with -1 to a whole number of chunks and
    ``lax.map`` runs gather + matvec per chunk, so the gathered rows stay in cache (see
    ``_XLA_CHUNK_BYTES``). At N == 1 the einsum is one [C, d] x [d] matvec.
    """
    n, c = idx.shape
    vocab_size, d = w.shape
    hf = h.astype(jnp.float32)

    def block(ids: Array) -> Array:  # [N, c'] -> [N, c']
        valid = _in_range(ids, vocab_size)
        rows = jnp.take(w, ids, axis=0, mode="clip").astype(jnp.float32)  # [N, c', d]
        logits = jnp.einsum("nd,ncd->nc", hf, rows, precision=lax.Precision.HIGHEST)
        return jnp.where(valid, logits, 0.0)

    chunk = _xla_chunk(n, c, d, w.dtype.itemsize)
    if chunk == c:
        return block(idx)
    num_chunks = -(-c // chunk)
    padded = jnp.pad(idx, ((0, 0), (0, num_chunks * chunk - c)), constant_values=-1)
    out = lax.map(block, padded.reshape(n, num_chunks, chunk).transpose(1, 0, 2))
    return out.transpose(1, 0, 2).reshape(n, num_chunks * chunk)[:, :c]


def _gathered_kernel(h_ref, w_ref, idx_ref, o_ref, *, block_c: int, block_d: int) -> None:
    """One program: row n = program_id(0), candidates [j*block_c, (j+1)*block_c), j = id(1).

    Refs: h_ref [d] (row n), w_ref [V, d] (whole), idx_ref [C] and o_ref [C] (row n). Every
    load and store is masked, so C and d need not be multiples of the blocks, and on the GPU a
    padding id costs no memory traffic: its W row is not read and its logit is written as 0.
    """
    c_total = idx_ref.shape[0]
    vocab_size, d = w_ref.shape
    cand = pl.program_id(1) * block_c + jnp.arange(block_c)
    in_c = cand < c_total
    ids = pltriton.load(idx_ref.at[cand], mask=in_c, other=-1)
    valid = _in_range(ids, vocab_size)
    rows = jnp.where(valid, ids, 0)[:, None]  # [block_c, 1]; in bounds even where masked

    def body(k: Array, acc: Array) -> Array:
        cols = k * block_d + jnp.arange(block_d)
        if d % block_d:  # static: only a ragged d needs the column mask
            in_d = cols < d
            hk = pltriton.load(h_ref.at[cols], mask=in_d, other=0.0)
            mask = valid[:, None] & in_d[None, :]
        else:
            hk = h_ref[cols]
            mask = valid[:, None]
        # Integer-array indexing on both axes (rows [block_c, 1], cols [1, block_d]) gathers
        # a [block_c, block_d] tile of contiguous row segments. `cols` is an array, not a
        # pl.ds: interpret mode discharges a mixed array/slice indexer for a plain ref read
        # but raises NotImplementedError for a masked load.
        wk = pltriton.load(w_ref.at[rows, cols[None, :]], mask=mask, other=0.0)
        return acc + jnp.sum(wk.astype(jnp.float32) * hk.astype(jnp.float32)[None, :], axis=1)

    acc = lax.fori_loop(0, pl.cdiv(d, block_d), body, jnp.zeros((block_c,), jnp.float32))
    # Explicit zero: a masked W load already contributes 0, but 0 * inf in h would be NaN.
    pltriton.store(o_ref.at[cand], jnp.where(valid, acc, 0.0), mask=in_c)


def _check_block(name: str, value: int) -> None:
    if value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a positive power of two (the Triton lowering "
                         f"requires power-of-two tiles), got {value}")


@functools.partial(jax.jit, static_argnames=("block_c", "block_d", "num_warps", "interpret"))
def gathered_matmul_pallas(h: Array, w: Array, idx: Array, *, block_c: int = 128,
                           block_d: int = 64, num_warps: int = 4,
                           interpret: bool = False) -> Array:
    """Pallas kernel (Triton lowering). Shapes as the reference; idx must be int32.

    Grid (N, cdiv(C, block_c)): each program gathers its block_c W rows ``block_d`` columns
    at a time and accumulates the dot with row n of h in float32 (a matvec per row: rows of
    h have their own candidates, so no W tile is shared across n). The blocks are clamped to
    the next power of two above C and d, so small problems do not waste lanes. The default
    tile, 128 x 64 float32, reads 256-byte row segments and keeps 64 values per thread.

    Args:
      block_c: candidates per program, a power of two.
      block_d: hidden columns per inner step, a power of two (64 divides d=576 exactly).
      num_warps: Triton warps per program.
      interpret: run the kernel body in the Pallas interpreter (any backend, e.g. CPU).
    """
    _check_block("block_c", block_c)
    _check_block("block_d", block_d)
    n, c = idx.shape
    d = w.shape[1]
    block_c = min(block_c, pl.next_power_of_2(c))
    block_d = min(block_d, pl.next_power_of_2(d))
    kernel = functools.partial(_gathered_kernel, block_c=block_c, block_d=block_d)
    return pl.pallas_call(
        kernel,
        grid=(n, pl.cdiv(c, block_c)),
        in_specs=[
            pl.BlockSpec((None, d), lambda i, j: (i, 0)),  # h: row i
            pl.no_block_spec,  # w: the whole [V, d] table, gathered by pointer
            pl.BlockSpec((None, c), lambda i, j: (i, 0)),  # idx: row i, sliced in-kernel
        ],
        # Every j of row i shares the block and writes only its own masked slice of it.
        out_specs=pl.BlockSpec((None, c), lambda i, j: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((n, c), jnp.float32),
        compiler_params=triton_params(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name=f"gathered_matmul_{block_c=}_{block_d=}",
    )(h, w, idx)


def gathered_matmul(h: Array, w: Array, idx: Array, *, impl: Impl = "auto") -> Array:
    """Shortlist logits ``out[n, c] = h[n] · w[idx[n, c]]`` in float32; padding ids give 0.

    h: [N, d] float, w: [V, d] float, idx: [N, C] integer -> [N, C] float32.
    ``impl``: "auto" (the Pallas kernel when the default backend is a GPU; on a CPU the
    rowdot kernel where :func:`~specjax.kernels.cpu_rowdot.use_rowdot` takes the operands;
    else XLA), "xla", "pallas", "rowdot" or "ref".
    """
    if h.ndim != 2 or w.ndim != 2 or idx.ndim != 2:
        raise ValueError(f"expected h [N, d], w [V, d] and idx [N, C]; got ranks "
                         f"h {h.ndim}, w {w.ndim}, idx {idx.ndim}")
    if h.shape[1] != w.shape[1]:
        raise ValueError(f"hidden size mismatch: h has d={h.shape[1]}, w has d={w.shape[1]}")
    if idx.shape[0] != h.shape[0]:
        raise ValueError(f"idx has {idx.shape[0]} rows but h has {h.shape[0]}: one candidate "
                         "list per row of h")
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ValueError(f"idx must be integer candidate ids, got dtype {idx.dtype}")
    for name, x in (("h", h), ("w", w)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got dtype {x.dtype}")
    impl = chosen_impl(h, w, impl)
    if impl == "rowdot":
        return rowdot_gathered(h, w, _as_int32_ids(idx, w.shape[0]))
    if impl == "pallas":
        return gathered_matmul_pallas(h, w, _as_int32_ids(idx, w.shape[0]))
    if impl == "xla":
        return gathered_matmul_xla(h, w, idx)
    if impl == "ref":
        return gathered_matmul_ref(h, w, idx)
    raise ValueError(f"unknown impl {impl!r}: expected 'auto', 'xla', 'pallas', 'rowdot' or "
                     "'ref'")


def chosen_impl(h: Array, w: Array, impl: Impl = "auto") -> str:
    """The implementation :func:`gathered_matmul` runs for these operands: ``impl``, or for
    "auto" the Pallas kernel on a GPU, the rowdot kernel where it takes ``h`` (a CPU, float32,
    1..16 rows, built), else XLA."""
    if impl != "auto":
        return impl
    return "pallas" if pallas_gpu_available() else "rowdot" if use_rowdot(h, w) else "xla"


def shared_gathered_matmul(h: Array, w: Array, idx: Array) -> Array:
    """One shortlist per batch row, scored by all of that row's ``K`` hidden states:
    ``out[b, k, c] = h[b, k] · w[idx[b, c]]``, padding ids 0.

    h: [B, K, d] float, w: [V, d], idx: [B, C] integer -> [B, K, C] float32. On a CPU the
    rowdot kernel reads each listed row once for the K states; elsewhere the rows are
    gathered once per batch row and contracted with XLA's dot.
    """
    if use_rowdot(h[0], w):
        ids = _as_int32_ids(idx, w.shape[0])
        return jax.vmap(lambda hb, ib: rowdot_gathered(hb, w, ib[None]))(h, ids)
    valid = _in_range(idx, w.shape[0])
    rows = jnp.take(w, jnp.where(valid, idx, 0), axis=0)  # [B, C, d]
    logits = jnp.einsum("bkd,bcd->bkc", h, rows, preferred_element_type=jnp.float32)
    return jnp.where(valid[:, None], logits, 0.0)


def _as_int32_ids(idx: Array, vocab_size: int) -> Array:
    """``idx`` as int32, padding mapped to -1 first (a cast could wrap it into range)."""
    if idx.dtype == jnp.int32:
        return idx
    return jnp.where(_in_range(idx, vocab_size), idx, -1).astype(jnp.int32)
