"""The draft phase on a synthetic state, and the drafters the benchmarks run.

:func:`draft_latency` times the jitted greedy draft phase on a :func:`synthetic_state`
(the state eager generation holds after ``context`` committed tokens), so a benchmark can
time drafting alone, for any tree and vocabulary head, without generating text.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

import specjax
from specjax.api import Drafter, Target
from specjax.bench.timing import time_calls
from specjax.drafter import init_drafter_cache
from specjax.model import init_cache
from specjax.sampling import SamplingConfig
from specjax.speculative import Engine, SpecState, TreeSpec, draft_phase_jit
from specjax.vocab.head import VocabHead, full_head


def random_features(shape: tuple[int, ...], dtype: Any, seed: int = 0) -> Array:
    """Unit-scale Gaussian features made in numpy (no compile for a throwaway array)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def synthetic_state(target: Target, drafter: Drafter, *, context: int, capacity: int,
                    out_len: int, seed: int = 0) -> SpecState:
    """A B=1 :class:`SpecState` as it stands after ``context`` committed tokens.

    Both caches have ``context`` rows committed (zeros: costs do not depend on values) in a
    ``capacity``-row buffer; the root feature is random. Shapes and dtypes are those of
    :func:`specjax.speculative.spec_prefill`'s state for the same capacity and ``out_len``,
    so the draft phase compiled here is the one eager generation runs. For timing only.
    """
    dtype = target.params.embed.dtype
    lengths = jnp.full((1,), context, jnp.int32)
    tcache = dataclasses.replace(init_cache(target.cfg, 1, capacity, dtype), lengths=lengths)
    dcache = dataclasses.replace(init_drafter_cache(drafter.cfg, 1, capacity, dtype),
                                 lengths=lengths)
    return SpecState(
        tcache=tcache, dcache=dcache, root=jnp.full((1,), 11 % target.cfg.vocab_size, jnp.int32),
        root_feat=random_features((1, target.cfg.hidden_size), dtype, seed),
        out=jnp.zeros((1, out_len), jnp.int32), num_new=jnp.ones((1,), jnp.int32),
        done=jnp.zeros((1,), bool), accept_lens=jnp.zeros((1, out_len), jnp.int32),
        steps=jnp.zeros((1,), jnp.int32), shortlist_size=jnp.zeros((1,), jnp.float32),
        shortlist_hits=jnp.zeros((1,), jnp.int32), key=jax.random.PRNGKey(seed),
        max_new=jnp.int32(out_len))


def greedy_engine(target: Target, drafter: Drafter, tree: TreeSpec) -> Engine:
    """The static engine :func:`specjax.generate` builds for greedy decoding."""
    return Engine(cfg=target.cfg, dcfg=drafter.cfg, tree=tree,
                  sampling=SamplingConfig(temperature=0.0).static())


def draft_latency(target: Target, drafter: Drafter, tree: TreeSpec, *, context: int,
                  capacity: int, out_len: int, runs: int,
                  head: VocabHead | None = None) -> dict[str, float]:
    """Latency of the jitted greedy draft phase (tree build with the drafter), B=1.

    ``head``: the vocabulary head (default: the full vocabulary).
    ``context`` committed rows of a ``capacity``-row cache; ``out_len``: the output buffer.
    """
    state = synthetic_state(target, drafter, context=context, capacity=capacity,
                            out_len=out_len)
    eng = greedy_engine(target, drafter, tree)
    temperature = jnp.float32(0.0)
    head = head or full_head(target.cfg.vocab_size)
    return time_calls(lambda: draft_phase_jit(target.params, drafter.params, head, state,
                                              temperature, eng=eng), runs)


def random_drafter(target: Target, seed: int = 0) -> Drafter:
    """An untrained EAGLE drafter (layer initialised from the target's last): MAL ~ 1.

    Only for checking the pipeline; its figures say nothing about speculative decoding.
    """
    from flax import nnx

    from specjax.drafter import DrafterConfig, EagleDrafter

    m = EagleDrafter(DrafterConfig(target.cfg), rngs=nnx.Rngs(seed),
                     init_layer=target.params.layers[-1])
    dtype = target.params.embed.dtype
    params = jax.tree.map(lambda a: a.astype(dtype), m.params())
    return Drafter(cfg=m.cfg, params=params, meta={"random": True, "seed": seed})


def resolve_drafter(drafter_dir: str | Path | None, target: Target) -> tuple[Drafter, str]:
    """(drafter, name) for ``drafter_dir``: a folder, None for the shipped one, "random"."""
    if drafter_dir is not None and str(drafter_dir) == "none":
        raise ValueError("this benchmark compares speculative with vanilla decoding and needs "
                         "a drafter: pass --drafter PATH (or 'random' to check the pipeline)")
    if drafter_dir is not None and str(drafter_dir) == "random":
        return random_drafter(target), "random"
    from specjax.defaults import default_drafter_dir

    path = Path(drafter_dir) if drafter_dir is not None else default_drafter_dir()
    return specjax.load_drafter(path, target), str(path)
