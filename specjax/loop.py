"""The decode contract that vanilla and speculative decoding share.

Both loops carry, inside their fixed-shape state:

* :class:`Limits`: the per-run limits (EOS ids, each row's token budget, temperature,
  top-p). They are arrays, so changing them never recompiles, and they travel in the
  state rather than as arguments threaded through every function (as gemma's sampler and
  levanter's engine carry theirs).
* :class:`Output`: the tokens committed so far, with one :meth:`Output.append` that both
  loops call: vanilla decoding appends one token per step, speculative decoding the
  accepted drafts plus the bonus token. It cuts each row at its first EOS and its budget.

:func:`prefill_target` is the prefill both start from, and :func:`run_until_done` the
``lax.while_loop`` both end in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp
from jax import Array

from specjax import pytree
from specjax.config import ModelConfig
from specjax.model import KVCache, Params, forward_hidden, init_cache
from specjax.sampling import StaticSampling, sample

PAD = -1  # Output slots past a row's last token.
S = TypeVar("S")


def bucket(n: int, minimum: int = 16) -> int:
    """Round up to a power of two (at least ``minimum``) so shapes repeat."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


@pytree.dataclass
class Limits:
    """What ends a row and how tokens are drawn: arrays, so one program serves any value.

    eos_ids: [E] int32 ids that end a row (``[-2]``: none).
    max_new: [B] int32 each row's budget of new tokens (<= the output's N slots).
    temperature: [] float32 (1.0 when greedy: the static sampling mode decides).
    top_p: [] float32 nucleus mass (1.0 = off).
    """

    eos_ids: Array
    max_new: Array
    temperature: Array
    top_p: Array

    def is_eos(self, tokens: Array) -> Array:
        """[...] bool: which of ``tokens`` [...] end a row."""
        return jnp.any(tokens[..., None] == self.eos_ids, axis=-1)


@pytree.dataclass
class Output:
    """The committed tokens of B rows in N static slots, and the sampling key.

    tokens: [B, N] int32; row b holds its new tokens in ``[0, num_new[b])``, PAD after.
    num_new: [B] int32 tokens committed so far (EOS included).
    done: [B] bool; a done row takes no more tokens and its caches stop growing.
    key: the PRNG key the next step splits.
    """

    tokens: Array
    num_new: Array
    done: Array
    key: Array

    @classmethod
    def start(cls, first: Array, limits: Limits, out_len: int, key: Array) -> Output:
        """The output after the prefill: each row's first sampled token [B] in slot 0."""
        b = first.shape[0]
        num_new = jnp.ones((b,), jnp.int32)
        return cls(tokens=jnp.full((b, out_len), PAD, jnp.int32).at[:, 0].set(first),
                   num_new=num_new, done=limits.is_eos(first) | (num_new >= limits.max_new),
                   key=key)

    def append(self, tokens: Array, count: Array, limits: Limits) -> tuple[Output, Array]:
        """Commit ``tokens[b, :count[b]]`` to each live row, cut after its first EOS and at
        its budget.

        Args:
          tokens: [B, T] int32 candidates, left-aligned; slots past ``count`` are ignored.
          count: [B] int32 how many of them the step commits (before the cuts).
        Returns:
          (the new output, [B] int32 tokens actually committed; 0 for rows already done).
        """
        b, t = tokens.shape
        live = ~self.done
        slot = jnp.arange(t)[None, :]
        eos_at = jnp.where(limits.is_eos(tokens) & (slot < count[:, None]), slot, t)
        first_eos = jnp.min(eos_at, axis=1)
        count = jnp.minimum(jnp.minimum(count, first_eos + 1), limits.max_new - self.num_new)
        count = jnp.where(live, count, 0)
        # Slots past a row's count are sent out of range and dropped.
        rows = jnp.where(slot < count[:, None], self.num_new[:, None] + slot,
                         self.tokens.shape[1])
        num_new = self.num_new + count
        out = dataclasses.replace(
            self, tokens=self.tokens.at[jnp.arange(b)[:, None], rows].set(tokens, mode="drop"),
            num_new=num_new,
            done=self.done | (live & (first_eos < t)) | (num_new >= limits.max_new))
        return out, count

    def split_key(self) -> tuple[Output, Array]:
        """(this output with its key advanced, a fresh subkey for the step)."""
        key, sub = jax.random.split(self.key)
        return dataclasses.replace(self, key=key), sub


def prefill_target(params: Params, cfg: ModelConfig, prompt: Array, prompt_lens: Array,
                   capacity: int,
                   tap_layers: tuple[int, ...] = ()) -> tuple[Array, KVCache, tuple[Array, ...]]:
    """Run the target over right-padded prompts into a fresh cache.

    Args:
      prompt: [B, P] int32; row b is valid in ``[0, prompt_lens[b])``. Padding positions
        are written to the cache too, but lie past ``lengths[b]``: later writes overwrite
        them and nothing attends to them.
      capacity: cache rows (>= P + the output + a step's spare rows).
      tap_layers: decoder layers whose outputs to return as well (EAGLE-3's features).
    Returns:
      (hidden [B, P, d] after the final norm, cache with ``lengths = prompt_lens``,
      taps [B, P, d] each).
    """
    b, p = prompt.shape
    cache = init_cache(cfg, b, capacity, params.embed.dtype)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    hidden, cache, taps = forward_hidden(params, cfg, prompt, positions, cache,
                                         tap_layers=tap_layers)
    return hidden, dataclasses.replace(cache, lengths=prompt_lens.astype(jnp.int32)), taps


def last_valid(x: Array, lengths: Array) -> Array:
    """x[b, lengths[b] - 1] for x [B, P, ...]: each row's last prompt position."""
    idx = (lengths - 1).reshape((-1, 1) + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)[:, 0]


def sample_first(logits: Array, limits: Limits, key: Array, sampling: StaticSampling,
                 out_len: int) -> Output:
    """Draw each row's first new token from the prompt's last logits [B, V]."""
    key, sub = jax.random.split(key)
    first = sample(sub, logits, sampling, limits.temperature, limits.top_p)
    return Output.start(first, limits, out_len, key)


def run_until_done(step: Callable[[S], S], state: S) -> S:
    """``step`` in one ``lax.while_loop`` until every row's ``state.output.done``."""
    return jax.lax.while_loop(lambda s: ~jnp.all(s.output.done), step, state)
