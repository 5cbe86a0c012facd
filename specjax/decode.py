"""Vanilla decoding: a prefill, then one fixed-shape ``lax.while_loop``.

The loop state is a registered dataclass whose shapes never change, so the
whole decode is one compiled program per (batch, prompt bucket, output bucket).
Lengths and limits travel as arrays, never as Python ints, to avoid recompiles.
The same :func:`decode_step` also runs eagerly, driven from Python.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import Array

from specjax.config import ModelConfig
from specjax.model import KVCache, Params, forward_hidden, init_cache, lm_head
from specjax.sampling import StaticSampling, sample

PAD = -1  # Output slots past a row's last token.


def bucket(n: int, minimum: int = 16) -> int:
    """Round up to a power of two (at least ``minimum``) so shapes repeat."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


@partial(jax.tree_util.register_dataclass,
         data_fields=["cache", "last", "out", "num_new", "done", "key", "max_new"],
         meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Carry of the decode loop. B rows, N output slots."""

    cache: KVCache
    last: Array  # [B] int32: the newest token, not yet in the cache.
    out: Array  # [B, N] int32: generated tokens, PAD after each row's end.
    num_new: Array  # [B] int32: tokens generated so far per row.
    done: Array  # [B] bool: row hit EOS or its budget.
    key: Array  # PRNG key.
    max_new: Array  # [] int32: the budget, <= N.


def _is_eos(tok: Array, eos_ids: Array) -> Array:
    return jnp.any(tok[:, None] == eos_ids[None, :], axis=-1)


@partial(jax.jit, static_argnames=("cfg", "sampling", "out_len", "capacity"))
def prefill(params: Params, cfg: ModelConfig, prompt: Array, prompt_lens: Array, key: Array,
            max_new: Array, eos_ids: Array, temperature: Array, top_p: Array, *,
            sampling: StaticSampling, out_len: int, capacity: int) -> DecodeState:
    """Run the prompts and sample each row's first new token.

    Args:
      prompt: [B, P] right-padded prompts; row b is valid in [0, prompt_lens[b]).
        Padding rows are written to the cache too but lie beyond
        ``lengths[b]``, so later writes overwrite them and nothing attends to them.
      eos_ids: [E] ids that end a row.
      out_len: N, the static output buffer (>= max_new).
      capacity: cache rows, >= P + N.
    """
    b, p = prompt.shape
    cache = init_cache(cfg, b, capacity, params.embed.dtype)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    hidden, cache, _ = forward_hidden(params, cfg, prompt, positions, cache)
    last_hidden = jnp.take_along_axis(hidden, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    key, sub = jax.random.split(key)
    first = sample(sub, lm_head(params, last_hidden), sampling, temperature, top_p)
    cache = dataclasses.replace(cache, lengths=prompt_lens.astype(jnp.int32))
    out = jnp.full((b, out_len), PAD, jnp.int32).at[:, 0].set(first)
    num_new = jnp.ones((b,), jnp.int32)
    done = _is_eos(first, eos_ids) | (num_new >= max_new)
    return DecodeState(cache=cache, last=first, out=out, num_new=num_new, done=done, key=key,
                       max_new=max_new)


def decode_step(params: Params, cfg: ModelConfig, state: DecodeState, eos_ids: Array,
                temperature: Array, top_p: Array, sampling: StaticSampling) -> DecodeState:
    """Feed ``last``, sample one token per unfinished row, append it."""
    cache = state.cache
    tokens = state.last[:, None]
    positions = cache.lengths[:, None]
    hidden, cache, _ = forward_hidden(params, cfg, tokens, positions, cache)
    key, sub = jax.random.split(state.key)
    nxt = sample(sub, lm_head(params, hidden[:, 0]), sampling, temperature, top_p)
    live = ~state.done
    # Finished rows keep their cache length; their writes land past it unseen.
    cache = dataclasses.replace(cache, lengths=cache.lengths + live)
    b = nxt.shape[0]
    # Slot num_new[b] is PAD until written; finished rows rewrite PAD there.
    out = state.out.at[jnp.arange(b), state.num_new].set(jnp.where(live, nxt, PAD), mode="drop")
    num_new = state.num_new + live
    done = state.done | (live & _is_eos(nxt, eos_ids)) | (num_new >= state.max_new)
    return DecodeState(cache=cache, last=jnp.where(live, nxt, state.last), out=out,
                       num_new=num_new, done=done, key=key, max_new=state.max_new)


@partial(jax.jit, static_argnames=("cfg", "sampling"), donate_argnames=("state",))
def decode_loop(params: Params, cfg: ModelConfig, state: DecodeState, eos_ids: Array,
                temperature: Array, top_p: Array, *, sampling: StaticSampling) -> DecodeState:
    """Run :func:`decode_step` until every row is done, in one ``lax.while_loop``."""

    def cond(s: DecodeState) -> Array:
        return ~jnp.all(s.done)

    def body(s: DecodeState) -> DecodeState:
        return decode_step(params, cfg, s, eos_ids, temperature, top_p, sampling)

    return jax.lax.while_loop(cond, body, state)


decode_step_jit = jax.jit(decode_step, static_argnames=("cfg", "sampling"),
                          donate_argnames=("state",))
