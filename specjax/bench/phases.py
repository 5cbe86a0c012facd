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
from specjax.bench.timing import time_calls
from specjax.drafter import in_target_layout
from specjax.loaded import Drafter, Target
from specjax.loop import Limits, Output
from specjax.model import init_cache
from specjax.sampling import SamplingConfig
from specjax.speculative import SpecConfig, SpecState, SpecStats, TreeSpec, draft_phase_jit
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
    dcache = dataclasses.replace(drafter.cfg.init_cache(1, capacity, dtype), lengths=lengths)
    sampling = SamplingConfig(temperature=0.0).dynamic()
    limits = Limits(eos_ids=jnp.asarray(target.eos_ids, jnp.int32),
                    max_new=jnp.full((1,), out_len, jnp.int32), **sampling)
    first = jnp.full((1,), 11 % target.cfg.vocab_size, jnp.int32)
    return SpecState(
        output=dataclasses.replace(Output.start(first, limits, out_len, jax.random.PRNGKey(seed)),
                                   done=jnp.zeros((1,), bool)),
        limits=limits, tcache=tcache, dcache=dcache, root=first,
        root_feat=random_features((1, drafter.cfg.width), dtype, seed),
        root_h=random_features((1, drafter.cfg.width), dtype, seed + 1),
        stats=SpecStats.zeros(1, out_len))


def greedy_spec(target: Target, drafter: Drafter, tree: TreeSpec) -> SpecConfig:
    """The static config :func:`specjax.generate` builds for greedy decoding."""
    return SpecConfig(cfg=target.cfg, drafter=drafter.cfg, tree=tree,
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
    # A lookup chain and a copy gate search a prompt as long as the context (its values do
    # not matter).
    if tree.reads_history:
        state = dataclasses.replace(state, prompt=jnp.zeros((1, context), jnp.int32))
    spec = greedy_spec(target, drafter, tree)
    head = head or full_head(target.cfg.vocab_size)
    if head.stateful:  # EvoSpec: a buffer of fixed capacity, so an empty one times the same
        state = dataclasses.replace(state, vocab=head.init_state(1))
    dparams = in_target_layout(drafter.params, target.params)  # as generate runs it
    return time_calls(lambda: draft_phase_jit(target.params, dparams, head, state, spec=spec),
                      runs)


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


def load_models(model_dir: str | Path, dtype: str | None, drafter: Drafter | None,
                drafter_dir: str | Path | None) -> tuple[Target, Drafter, str]:
    """(target, drafter, drafter name) for a benchmark: ``drafter`` if given (tests), else
    :func:`resolve_drafter` of ``drafter_dir``."""
    target = specjax.load(model_dir, dtype)
    if drafter is not None:
        return target, drafter, str(drafter.path) if drafter.path is not None else "in-memory"
    return target, *resolve_drafter(drafter_dir, target)


def resolve_drafter(drafter_dir: str | Path | None, target: Target) -> tuple[Drafter, str]:
    """(drafter, name) for ``drafter_dir``: a folder, None for the one shipped for the
    target (:func:`specjax.defaults.shipped_drafter_for`), "random"."""
    if drafter_dir is not None and str(drafter_dir) == "none":
        raise ValueError("this benchmark compares speculative with vanilla decoding and needs "
                         "a drafter: pass --drafter PATH (or 'random' to check the pipeline)")
    if drafter_dir is not None and str(drafter_dir) == "random":
        return random_drafter(target), "random"
    from specjax.defaults import shipped_drafter_for

    path = Path(drafter_dir) if drafter_dir is not None else shipped_drafter_for(target.cfg)
    if path is None:
        raise ValueError("no drafter is shipped for this target; pass --drafter PATH (train "
                         "one with `specjax train drafter`) or --drafter random")
    return specjax.load_drafter(path, target), str(path)
