"""Attention of a few new tokens over a KV cache for XLA:CPU (C++ through XLA FFI), and its
reference.

``cache_attention(q, k_cache, v_cache, lengths, block_mask, scale)`` is the attention of a
decode or verify step's T = 1..:data:`MAX_QUERIES` new tokens (a tree's nodes, or a drafter's
frontier) over the cache they were just written into, with the visibility of
:func:`specjax.model.cache_mask`: every committed row ``s < lengths[b]``, and block row
``lengths[b] + j`` where ``block_mask[b, t, j]``. Its reference is the model's own dense
masked softmax (:func:`cache_attention_reference`), which on XLA:CPU reads every one of the
cache's S rows (its capacity, not the rows in use), transposes K and V to head-major first and
selects over a [B, Hkv, G, T, S] mask; the kernel reads the visible rows once per group of
queries in the cache's [B, S, Hkv, Dh] layout. Thirty SmolLM2 layers at an 800-row prefix
(capacity 1,024): 24.2 -> 2.7 ms for one query, 27.9 -> 4.8 ms for four
(docs/benchmarks.md, fiftieth session). Where its chunks of work would leave cores idle (batch
1, few KV heads) and the cache is long, it splits each query group's rows across cores and
combines the parts as flash-decoding does (``splits``; docs/kernels.md).

The source, ``cpu_attention.cc``, is built with the other CPU kernels
(:mod:`specjax.kernels.cpu_build`). :func:`specjax.model.attention` takes it where
:func:`use_cpu_attention` says so; ``SPECJAX_CPU_ATTENTION=off`` keeps XLA's, and ``dots`` or
``lanes`` force the kernel's score layout (:func:`env_scores`; for A/B runs, default ``auto``).
"""

from __future__ import annotations

import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels.cpu_build import available, kernels_enabled

Array = jax.Array
TARGET = "specjax_cpu_cache_attention"
# Queries per call the kernel takes: a tree's nodes, or a prefill chunk (specjax.loop), whose
# rows past 128 buy little more from fewer weight passes (docs/benchmarks.md, seventy-second
# session).
MAX_QUERIES = 128
MAX_SPLITS = 16  # cpu_attention.cc's kMaxSplits
# How a chunk lays out its scores (cpu_attention.cc): "auto" lets the kernel choose from the
# queries a KV head, "dots" is a dot product per query and row, "lanes" one query a lane.
SCORE_LAYOUTS = ("auto", "dots", "lanes")


def cache_attention_reference(q: Array, k_cache: Array, v_cache: Array, lengths: Array,
                              block_mask: Array, scale: float) -> Array:
    """The specification: :func:`specjax.model.masked_attention` over
    :func:`specjax.model.cache_mask`. Shapes as in :func:`cache_attention`."""
    from specjax.model import cache_mask, masked_attention  # the model imports this module

    mask = cache_mask(lengths, block_mask, k_cache.shape[1])
    return masked_attention(q, k_cache, v_cache, mask, scale)


def _call(q: Array, k_cache: Array, v_cache: Array, lengths: Array, block_mask: Array,
          scale: float, splits: int, scores: str) -> Array:
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(
        q, k_cache, v_cache, lengths, block_mask, scale=np.float32(scale),
        splits=np.int64(splits), scores=np.int64(SCORE_LAYOUTS.index(scores)))


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _cache_attention(q, k_cache, v_cache, lengths, block_mask, scale, splits, scores):
    return _call(q, k_cache, v_cache, lengths, block_mask, scale, splits, scores)


def _fwd(q, k_cache, v_cache, lengths, block_mask, scale, splits, scores):
    return (_call(q, k_cache, v_cache, lengths, block_mask, scale, splits, scores),
            (q, k_cache, v_cache, lengths, block_mask))


def _bwd(scale, splits, scores, res, g):
    # Inference runs this attention; a gradient (an online adapter's few rows) goes through
    # the reference.
    q, k_cache, v_cache, lengths, block_mask = res
    _, vjp = jax.vjp(lambda a, b, c: cache_attention_reference(a, b, c, lengths, block_mask,
                                                               scale), q, k_cache, v_cache)
    return (*vjp(g), None, None)


_cache_attention.defvjp(_fwd, _bwd)


def cache_attention(q: Array, k_cache: Array, v_cache: Array, lengths: Array,
                    block_mask: Array, scale: float, splits: int = 0,
                    scores: str = "auto") -> Array:
    """GQA attention of T new tokens over a KV cache, on XLA:CPU.

    Args:
      q: [B, T, H, Dh] float32 queries (RoPE applied), H = Hkv * G.
      k_cache, v_cache: [B, S, Hkv, Dh] float32, the new tokens' K/V already written.
      lengths: [B] int32 committed rows per batch row.
      block_mask: [B, T, R] bool; query t sees block row ``lengths[b] + j`` (< S) where
        ``block_mask[b, t, j]``.
      scale: the score scale (1 / sqrt(Dh) for most models).
      splits: how many ranges each query group's cache rows are cut into, each range on a
        core of its own and the parts combined as flash-decoding does; 0 (the default) lets
        the kernel choose from its thread pool's size, the chunks and the cache's length
        (more than one only where the chunks alone leave cores idle and each range keeps
        256 rows or more). At most 16.
      scores: how each chunk of queries lays out its scores: "dots" (per query, a dot product
        with each row, summed across the vector), "lanes" (one query a vector lane, one FMA
        per row and element of Dh; cheaper per score where a KV head has many queries,
        wasted lanes where it has few) or "auto" (the default: lanes where a KV head's T * G
        queries, in as few and as even groups of up to a vector as they fit, fill at least
        3/4 of the lanes, e.g. 12 to 16 on AVX-512). Like ``splits``, it changes summation
        order only.

    Returns:
      [B, T, H, Dh] float32, equal to :func:`cache_attention_reference` up to summation order
      (a query that sees no row gets the mean of all S value rows, as the reference does).
    """
    b, t, h, dh = q.shape
    if any(a.dtype != jnp.float32 for a in (q, k_cache, v_cache)):
        raise TypeError(f"cache_attention takes float32, got q {q.dtype}, k {k_cache.dtype} "
                        f"and v {v_cache.dtype}")
    if (k_cache.ndim != 4 or v_cache.shape != k_cache.shape or k_cache.shape[0] != b
            or k_cache.shape[3] != dh or k_cache.shape[2] == 0 or h % k_cache.shape[2]
            or lengths.shape != (b,)
            or block_mask.ndim != 3 or block_mask.shape[:2] != (b, t)):
        raise ValueError(f"cache_attention needs q [B, T, H, Dh], k and v [B, S, Hkv, Dh] "
                         f"with H % Hkv == 0, lengths [B] and block_mask [B, T, R]; got q "
                         f"{q.shape}, k {k_cache.shape}, v {v_cache.shape}, lengths "
                         f"{lengths.shape}, block_mask {block_mask.shape}")
    if dh == 0 or dh % 16:
        raise ValueError(f"cache_attention needs Dh > 0 and Dh % 16 == 0 (whole SIMD vectors); "
                         f"Dh = {dh}")
    if not 0 <= splits <= MAX_SPLITS:
        raise ValueError(f"cache_attention's splits must be 0 (chosen) to {MAX_SPLITS}, "
                         f"got {splits}")
    if scores not in SCORE_LAYOUTS:
        raise ValueError(f"cache_attention's scores must be one of {SCORE_LAYOUTS}, got "
                         f"{scores!r}")
    ok, why = available()
    if not ok:
        raise RuntimeError(f"the CPU attention kernel is not available here: {why}; use "
                           "cache_attention_reference instead")
    return _cache_attention(q, k_cache, v_cache, lengths.astype(jnp.int32),
                            block_mask.astype(bool), float(scale), int(splits), scores)


def env_scores() -> str:
    """The score layout the model asks the kernel for, read at trace time:
    ``SPECJAX_CPU_ATTENTION`` if it names one ("dots", "lanes"), else "auto"."""
    setting = os.environ.get("SPECJAX_CPU_ATTENTION", "auto").lower()
    return setting if setting in SCORE_LAYOUTS else "auto"


def use_cpu_attention(q: Array, k_cache: Array, window: int | None = None) -> bool:
    """Whether :func:`specjax.model.attention` sends this attention to the kernel (decided at
    trace time): float32 q and cache, 1..MAX_QUERIES new tokens, Dh % 16 == 0, no sliding
    window (its mask is on positions, which the kernel does not read), a CPU backend with one
    device in use (no active mesh), the kernel built, and ``SPECJAX_CPU_ATTENTION`` not
    ``off``."""
    from specjax.sharding import active_mesh

    return (kernels_enabled("SPECJAX_CPU_ATTENTION") and window is None
            and q.dtype == jnp.float32 and k_cache.dtype == jnp.float32
            and 1 <= q.shape[1] <= MAX_QUERIES and q.shape[-1] % 16 == 0
            and jax.default_backend() == "cpu" and active_mesh() is None and available()[0])
