"""Turning logits into the target's sampling distribution, and drawing from it.

The split between static and traced settings avoids recompiles: whether to
sample at all, and the top-k width, change the program; temperature and top-p
are values carried as arrays.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import Array

from specjax._checks import check_int, check_real


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 disables top-k.
    top_p: float = 1.0  # 1.0 disables nucleus filtering.

    def __post_init__(self):
        # Non-finite values would pass a plain range test (inf >= 0) and sample noise.
        object.__setattr__(self, "temperature", check_real(
            "temperature", self.temperature, minimum=0.0, hint="0 = greedy"))
        object.__setattr__(self, "top_k", check_int("top_k", self.top_k, minimum=0,
                                                    hint="0 = off"))
        object.__setattr__(self, "top_p", check_real("top_p", self.top_p, minimum=0.0,
                                                     maximum=1.0, open_min=True,
                                                     hint="1 = off"))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def static(self) -> StaticSampling:
        return StaticSampling(greedy=self.greedy, top_k=self.top_k, use_top_p=self.top_p < 1.0)

    def dynamic(self) -> dict[str, Array]:
        t = self.temperature if self.temperature > 0 else 1.0
        return {"temperature": jnp.float32(t), "top_p": jnp.float32(self.top_p)}


@dataclasses.dataclass(frozen=True)
class StaticSampling:
    """The jit-static part of a :class:`SamplingConfig`."""

    greedy: bool
    top_k: int
    use_top_p: bool


def filter_logits(logits: Array, s: StaticSampling, temperature: Array, top_p: Array) -> Array:
    """Scaled, top-k and top-p filtered logits [..., V]; dropped entries are -inf."""
    logits = logits.astype(jnp.float32) / temperature
    if s.top_k:
        kth = jax.lax.top_k(logits, s.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if s.use_top_p:
        sorted_desc = -jnp.sort(-logits, axis=-1)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        # Keep a token if the mass strictly before it is < top_p: the smallest
        # set reaching top_p, and always the most likely token.
        before = jnp.cumsum(probs, axis=-1) - probs
        kept = jnp.where(before < top_p, sorted_desc, jnp.inf)
        threshold = jnp.min(kept, axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def target_probs(logits: Array, s: StaticSampling, temperature: Array, top_p: Array) -> Array:
    """The distribution sampling draws from, [..., V] (one-hot argmax if greedy)."""
    if s.greedy:
        return jax.nn.one_hot(first_argmax(logits), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(filter_logits(logits, s, temperature, top_p), axis=-1)


def first_argmax(x: Array) -> Array:
    """``jnp.argmax(x, axis=-1)`` as two single-operand reductions: [..., V] -> [...] int32.

    XLA:CPU runs argmax's (value, index) reduction as a scalar loop, and fuses the argument's
    elementwise producer into it: for a draw, the Gumbel noise (two logs per id) then runs
    unvectorised too. A max, then the smallest index holding it, are plain reductions it
    vectorises; a draw over SmolLM2's 49,152 ids costs a third as much, and greedy
    verification's argmax over a tree's rows a sixth (docs/benchmarks.md). Every argmax over
    the vocabulary in the loops is this one. The index is jnp.argmax's, ties and NaN
    included (the first NaN wins, as there).
    """
    v = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)
    hit = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, jnp.arange(v, dtype=jnp.int32), v), axis=-1)


def categorical(key: Array, logits: Array) -> Array:
    """One draw per row from softmax(logits): [..., V] -> [...] int32.

    The token ``jax.random.categorical(key, logits, axis=-1)`` draws (the argmax of the
    logits plus Gumbel noise from the same key), through :func:`first_argmax`. -inf logits
    are never drawn unless every logit of the row is -inf (then id 0, as there).
    """
    return first_argmax(logits + jax.random.gumbel(key, logits.shape, logits.dtype))


def sample(key: Array, logits: Array, s: StaticSampling, temperature: Array,
           top_p: Array) -> Array:
    """One token per row. logits: [B, V] -> [B] int32."""
    if s.greedy:
        return first_argmax(logits)
    return categorical(key, filter_logits(logits, s, temperature, top_p))
