"""Vanilla decoding: a prefill, then one fixed-shape ``lax.while_loop``.

The loop state is a registered dataclass whose shapes never change, so the
whole decode is one compiled program per (batch, prompt bucket, output bucket).
Lengths and limits travel as arrays inside the state (:class:`specjax.loop.Limits`),
never as Python ints, to avoid recompiles. The same :func:`decode_step` also runs
eagerly, driven from Python (``mode="eager"``, :func:`specjax.stream`).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import Array

from specjax import pytree
from specjax.config import ModelConfig
from specjax.loop import Limits, Output, last_valid, prefill_target, run_until_done, sample_first
from specjax.model import KVCache, Params, forward_hidden, lm_head
from specjax.sampling import StaticSampling, sample
from specjax.sharding import constrain_state


@pytree.dataclass
class DecodeState:
    """Carry of the vanilla loop: the output, the run's limits, the cache, the newest token."""

    output: Output
    limits: Limits
    cache: KVCache  # lengths[b] committed rows; ``last`` is not among them yet
    last: Array  # [B] int32 the newest token


@partial(jax.jit, static_argnames=("cfg", "sampling", "out_len", "capacity"))
def prefill(params: Params, cfg: ModelConfig, prompt: Array, prompt_lens: Array,
            limits: Limits, key: Array, *, sampling: StaticSampling, out_len: int,
            capacity: int) -> DecodeState:
    """Run the prompts and sample each row's first new token.

    Args:
      prompt: [B, P] right-padded prompts; row b is valid in [0, prompt_lens[b]).
      out_len: N, the static output buffer (>= every row's ``limits.max_new``).
      capacity: cache rows, see :func:`specjax.speculative.cache_capacity`.
    """
    hidden, cache, _ = prefill_target(params, cfg, prompt, prompt_lens, capacity)
    output = sample_first(lm_head(params, last_valid(hidden, prompt_lens)), limits, key,
                          sampling, out_len)
    return constrain_state(DecodeState(output=output, limits=limits, cache=cache,
                                       last=output.tokens[:, 0]))


def decode_step(params: Params, cfg: ModelConfig, state: DecodeState,
                sampling: StaticSampling) -> DecodeState:
    """Feed ``last``, sample one token per unfinished row, append it."""
    cache = state.cache
    hidden, cache, _ = forward_hidden(params, cfg, state.last[:, None], cache.lengths[:, None],
                                      cache)
    output, sub = state.output.split_key()
    nxt = sample(sub, lm_head(params, hidden[:, 0]), sampling, state.limits.temperature,
                 state.limits.top_p)
    live = ~output.done
    output, _ = output.append(nxt[:, None], jnp.ones_like(nxt), state.limits)
    # Finished rows keep their cache length; their writes land past it unseen. Under a
    # mesh the carry keeps one layout from step to step (constrain_state).
    return constrain_state(DecodeState(
        output=output, limits=state.limits,
        cache=dataclasses.replace(cache, lengths=cache.lengths + live),
        last=jnp.where(live, nxt, state.last)))


@partial(jax.jit, static_argnames=("cfg", "sampling"), donate_argnames=("state",))
def decode_loop(params: Params, cfg: ModelConfig, state: DecodeState, *,
                sampling: StaticSampling) -> DecodeState:
    """Run :func:`decode_step` until every row is done, in one ``lax.while_loop``."""
    return run_until_done(lambda s: decode_step(params, cfg, s, sampling), state)


decode_step_jit = jax.jit(decode_step, static_argnames=("cfg", "sampling"),
                          donate_argnames=("state",))
