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
import os
from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp
from jax import Array
from jax.typing import DTypeLike

from specjax import pytree
from specjax.config import ModelConfig
from specjax.kernels.cpu_attention import MAX_QUERIES, use_cpu_attention
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


# Rows a prefill chunk takes on a CPU: the attention kernel's most queries; the last chunk
# runs as PREFILL_TAIL rows where those cover the rest, so a prompt's padding is under 64
# rows. One pass over a long bucket paid the dense masked softmax over the whole cache and
# the bucket's padding (a 700-token prompt in the 1,024 bucket: 2.7 s, against 1.15 s in
# 64-row chunks on this project's 2-core machine; 128-row chunks cost 0.83-0.89 of 64-row
# ones a row; docs/benchmarks.md, seventy-second session).
PREFILL_CHUNK = MAX_QUERIES
PREFILL_TAIL = MAX_QUERIES // 2


def prefill_chunks(cfg: ModelConfig, dtype: DTypeLike, batch: int, p: int,
                   capacity: int) -> tuple[int, int | None]:
    """(rows a chunk, rows of a last chunk or None) for a [batch, p] prompt's prefill
    (:func:`in_chunks`): (:data:`PREFILL_CHUNK`, :data:`PREFILL_TAIL`) where the CPU attention
    kernel takes such a block (float32 on a CPU, no mesh; decided at trace time), else
    (``p``, None): one pass, as accelerators want. ``SPECJAX_PREFILL_CHUNK`` overrides the
    chunk, without a tail (``0``: one pass), for A/B runs."""
    env = os.environ.get("SPECJAX_PREFILL_CHUNK", "").strip()
    if env:
        return (p if int(env) <= 0 else min(int(env), p)), None
    c = min(PREFILL_CHUNK, p)
    q = jax.ShapeDtypeStruct((batch, c, cfg.num_heads, cfg.head_dim), dtype)
    k = jax.ShapeDtypeStruct((batch, capacity, cfg.num_kv_heads, cfg.head_dim), dtype)
    return (c, PREFILL_TAIL) if use_cpu_attention(q, k) else (p, None)


PrefillPass = Callable[[tuple[Array, ...], Array, KVCache], tuple[tuple[Array, ...], KVCache]]


def in_chunks(run: PrefillPass, inputs: tuple[Array, ...], cache: KVCache, prompt_lens: Array,
              chunk: int, tail: int | None = None) -> tuple[tuple[Array, ...], KVCache]:
    """A prefill over [B, P, ...] ``inputs`` as ``chunk``-row blocks, in one ``fori_loop``.

    ``run(block, positions [B, c], cache)`` is one pass: ``block`` holds each input's rows
    [start, start + c), the cache's ``lengths`` are ``start`` (its new rows go there), and it
    returns ([B, c, ...] outputs, cache). The loop runs the longest row's chunks only, so a
    bucket's padding past them costs nothing; a row whose prompt ended earlier writes padding
    past its final length, which later writes overwrite and nothing attends to. With
    ``tail`` (< ``chunk``), the last chunk runs as ``tail`` rows where those cover the
    longest row's rest (a second traced pass). ``chunk >= P`` is one pass; a P that is
    not a multiple of ``chunk`` is padded to one.

    Returns ([B, P, ...] outputs, zero where no chunk ran; cache with ``lengths =
    prompt_lens``).
    """
    b, p = inputs[0].shape[:2]
    c = min(chunk, p)
    if p % c:  # pad to whole chunks; rows past the cache's capacity are dropped on write
        padded = tuple(jnp.pad(x, [(0, 0), (0, -p % c)] + [(0, 0)] * (x.ndim - 2))
                       for x in inputs)
        outs, cache = in_chunks(run, padded, cache, prompt_lens, c, tail)
        return tuple(o[:, :p] for o in outs), cache

    def run_at(start: Array | int, rows: int, carry: tuple) -> tuple:
        outs, cache = carry
        block = tuple(jax.lax.dynamic_slice_in_dim(x, start, rows, axis=1) for x in inputs)
        positions = jnp.broadcast_to(start + jnp.arange(rows, dtype=jnp.int32), (b, rows))
        new, cache = run(block, positions, dataclasses.replace(
            cache, lengths=jnp.full((b,), start, jnp.int32)))
        if outs is None:
            return new, cache
        return tuple(jax.lax.dynamic_update_slice_in_dim(o, n, start, axis=1)
                     for o, n in zip(outs, new, strict=True)), cache

    if c == p:
        outs, cache = run_at(0, p, (None, cache))
    else:
        shapes = jax.eval_shape(lambda: run_at(0, c, (None, cache))[0])
        carry = (tuple(jnp.zeros((s.shape[0], p) + s.shape[2:], s.dtype) for s in shapes),
                 cache)
        # Whole chunks, and one more unless the rest fits a tail (start + tail <= P: the
        # start is a multiple of c below P, and P a multiple of c).
        tail = tail if tail is not None and 0 < tail < c else 0
        full, rest = jnp.max(prompt_lens) // c, jnp.max(prompt_lens) % c
        carry = jax.lax.fori_loop(0, full + (rest > tail), lambda i, x: run_at(i * c, c, x),
                                  carry)
        if tail:
            carry = jax.lax.cond((rest > 0) & (rest <= tail),
                                 lambda x: run_at(full * c, tail, x), lambda x: x, carry)
        outs, cache = carry
    return outs, dataclasses.replace(cache, lengths=prompt_lens.astype(jnp.int32))


def prefill_target(params: Params, cfg: ModelConfig, prompt: Array, prompt_lens: Array,
                   capacity: int,
                   tap_layers: tuple[int, ...] = ()) -> tuple[Array, KVCache, tuple[Array, ...]]:
    """Run the target over right-padded prompts into a fresh cache, in chunks of
    :func:`prefill_chunks` rows (:func:`in_chunks`).

    Args:
      prompt: [B, P] int32; row b is valid in ``[0, prompt_lens[b])``.
      capacity: cache rows (>= P + the output + a step's spare rows).
      tap_layers: decoder layers whose outputs to return as well (EAGLE-3's features).
    Returns:
      (hidden [B, P, d] after the final norm, cache with ``lengths = prompt_lens``,
      taps [B, P, d] each). Positions past ``prompt_lens[b]`` are not meaningful.
    """
    b, p = prompt.shape
    dtype = params.embed.dtype

    def run(block: tuple[Array, ...], positions: Array, cache: KVCache):
        hidden, cache, taps = forward_hidden(params, cfg, block[0], positions, cache,
                                             tap_layers=tap_layers)
        return (hidden, *taps), cache

    (hidden, *taps), cache = in_chunks(run, (prompt,), init_cache(cfg, b, capacity, dtype),
                                       prompt_lens, *prefill_chunks(cfg, dtype, b, p, capacity))
    return hidden, cache, tuple(taps)


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
