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
    """Scaled, top-k and top-p filtered logits [..., V]; dropped entries are -inf.

    Top-k keeps the ids at or above the k-th largest logit (ties with it included); top-p
    then keeps, of what is left, each id whose logit is at or above that of the last id
    kept by the sorted rule: an id is kept when the mass of the ids strictly more likely
    than it is < top_p (the smallest set reaching top_p, whole tie groups, and always the
    most likely id). Neither threshold sorts the row (:func:`kth_largest`,
    :func:`nucleus_threshold`).
    """
    logits = logits.astype(jnp.float32) / temperature
    if s.top_k:
        logits = jnp.where(logits < kth_largest(logits, s.top_k), -jnp.inf, logits)
    if s.use_top_p:
        logits = jnp.where(logits < nucleus_threshold(logits, top_p), -jnp.inf, logits)
    return logits


def kth_largest(x: Array, k: int) -> Array:
    """The k-th largest value of each row, counting ties: x [..., V] float32 -> [..., 1].

    The smallest of ``lax.top_k``'s values, not its last one: XLA:CPU runs a top-k as a
    fast partial selection only where it sees a sort whose first k entries are used
    whole, and slicing one entry out turns it back into a sort of the whole row (8 ms a
    row over SmolLM2's 49,152 ids, against 0.1 ms; the test reads the compiled program).
    """
    return jnp.min(jax.lax.top_k(x, k)[0], axis=-1, keepdims=True)


# Bisection steps over float32's 2^32 ordered bit patterns: the search ends on the exact
# value it looks for.
_ORDER_STEPS = 32


def _order_key(x: Array) -> Array:
    """float32 [...] -> uint32 [...] in the floats' order (-inf lowest, +inf highest; -0
    just below +0), so a bisection over the keys walks the floats."""
    b = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(b >> 31 == 1, ~b, b | jnp.uint32(0x80000000))


def _key_float(k: Array) -> Array:
    """The inverse of :func:`_order_key`."""
    b = jnp.where(k >> 31 == 1, k & jnp.uint32(0x7FFFFFFF), ~k)
    return jax.lax.bitcast_convert_type(b, jnp.float32)


# Ids the nucleus is first looked for among, by their logits' ``lax.top_k`` read whole. A
# model's nucleus at top-p 0.9 is rarely wider: 256 ids or fewer at 97% of SmolLM2's
# positions and 95% of Gemma 3's (median 9 and 19 ids; docs/benchmarks.md).
NUCLEUS_CANDIDATES = 256


def nucleus_threshold(x: Array, top_p: Array, candidates: int = NUCLEUS_CANDIDATES) -> Array:
    """The smallest logit top-p keeps in each row: x [..., V] float32 (-inf: dropped
    before), top_p scalar or [..., 1] in (0, 1] -> [..., 1].

    Two ways to one answer, neither a sort of the row (XLA:CPU sorts 49,152 ids in 10 ms,
    262,144 in 74 ms):

    * among the ``candidates`` largest logits (:func:`_nucleus_among_top`), where every
      row's nucleus ends inside them: a ``lax.top_k`` and a running sum over its values;
    * else, for all rows, a bisection over the whole row (:func:`_bisect_nucleus`), 32
      passes of masked sums.

    One ``lax.cond`` over all rows picks, so a step pays the bisection only where some
    row's nucleus is wider than ``candidates`` (under ``vmap`` a ``cond`` runs both ways;
    the loops call this on whole [B, T, V] blocks, unmapped). The two keep the same ids
    except within float32 rounding of top_p: both sum in float32, in other orders than a
    float64 reference (ids of a millionth of the mass at top_p 0.9999; none at 0.9 on
    every row tested).

    Args:
      candidates: how many of the largest logits the first way reads (tests pass fewer
        to reach the bisection).
    """
    bound, top = _nucleus_mass(x, top_p)
    found, covered = _nucleus_among_top(x, bound, top, min(candidates, x.shape[-1]))
    return jax.lax.cond(jnp.all(covered), lambda: found,
                        lambda: _bisect_nucleus(x, bound, top))


def _nucleus_mass(x: Array, top_p: Array) -> tuple[Array, Array]:
    """x [..., V] -> (top_p times the sum of the unnormalised probabilities exp(x - top)
    [..., 1], the largest logit top [..., 1]). One fused pass: the probabilities are not
    kept, so the top-k path never writes a row's worth of them."""
    top = jnp.max(x, axis=-1, keepdims=True)
    return top_p * jnp.sum(jnp.exp(x - top), axis=-1, keepdims=True), top


def _nucleus_among_top(x: Array, bound: Array, top: Array, k: int) -> tuple[Array, Array]:
    """The nucleus found among each row's k largest logits: (its smallest logit [..., 1],
    whether that is the whole row's answer [..., 1] bool).

    An id is kept when the mass of the ids strictly above it is < ``bound``. In the
    descending order, the mass before an id counts its tie group's earlier members too,
    but the last id whose mass before is < bound has the logit of the last id kept: the
    first id of its tie group has exactly the mass above the group before it. The answer
    holds for the whole row when the k ids' mass reaches the bound: every logit below the
    k-th has at least that much above it. The values are read whole (max, exp, cumsum):
    XLA:CPU keeps a ``lax.top_k`` a partial selection only then (:func:`kth_largest`).
    """
    values = jax.lax.top_k(x, k)[0]
    w = jnp.exp(values - top)
    before = jnp.cumsum(w, axis=-1) - w
    found = jnp.min(jnp.where(before < bound, values, jnp.inf), axis=-1, keepdims=True)
    return found, jnp.sum(w, axis=-1, keepdims=True) >= bound


def _bisect_nucleus(x: Array, bound: Array, top: Array) -> Array:
    """The smallest logit top-p keeps, by bisection over the whole row [..., V] -> [..., 1]
    (``bound`` and ``top`` from :func:`_nucleus_mass`).

    The mass strictly above a value only falls as the value rises, and it is constant
    between two neighbouring logits, so the smallest value whose mass above is < bound is
    a logit: the last id the sorted rule keeps. The search walks float32's ordered bit
    patterns (:func:`_order_key`), 32 passes of masked sums over the row (0.4 ms a row
    over 49,152 ids, against 10 ms for a sort).
    """
    weight = jnp.exp(x - top)  # 0 where x is -inf
    lo = _order_key(jnp.min(x, axis=-1, keepdims=True))
    hi = _order_key(top)  # nothing lies above the top: its mass above, 0, is < bound

    def step(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        above = jnp.sum(jnp.where(x > _key_float(mid), weight, 0.0), axis=-1, keepdims=True)
        kept = above < bound
        return jnp.where(kept, lo, mid + 1), jnp.where(kept, mid, hi)

    _, hi = jax.lax.fori_loop(0, _ORDER_STEPS, step, (lo, hi))
    # XLA:CPU compares subnormals as 0, so the search can stop on one beside a 0 entry;
    # the smallest entry at or above the bound is the row's own value either way.
    found = _key_float(hi)
    return jnp.min(jnp.where(x >= found, x, jnp.inf), axis=-1, keepdims=True)


def target_probs(logits: Array, s: StaticSampling, temperature: Array, top_p: Array) -> Array:
    """The distribution sampling draws from, [..., V] (one-hot argmax if greedy)."""
    if s.greedy:
        return jax.nn.one_hot(first_argmax(logits), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(filter_logits(logits, s, temperature, top_p), axis=-1)


def first_argmax(x: Array) -> Array:
    """``jnp.argmax(x, axis=-1)`` as two single-operand reductions: [..., V] -> [...] int32.

    XLA:CPU runs argmax's (value, index) reduction as a scalar loop. A max, then the
    smallest index holding it, are plain reductions it vectorises: greedy verification's
    argmax over a tree's rows costs a third (4 rows) to a sixth (14 rows) as much inside a
    compiled loop (docs/benchmarks.md). Every argmax over
    the vocabulary in the loops is this one. The index is jnp.argmax's, ties and NaN
    included (the first NaN wins, as there).
    """
    v = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)
    hit = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, jnp.arange(v, dtype=jnp.int32), v), axis=-1)


# Ids per block of draw()'s two-level search: a block's prefix sums are a short scan, and
# the blocks' sums one reduction XLA vectorises.
DRAW_BLOCK = 128


def draw(key: Array, weights: Array) -> Array:
    """One draw per row with probability weights / sum(weights): [..., V] -> [...] int32.

    Inverse-CDF sampling with one uniform a row, in two levels: the block whose running
    sum first exceeds u * total (over :data:`DRAW_BLOCK`-id blocks), then the id inside it
    whose running sum does. An id of zero weight is never drawn (a search that rounding
    leaves on one moves to the next id of positive weight, or the last; see
    :func:`_first_past`); a row of all zeros gives id 0.

    Against Gumbel-max over the vocabulary (``jax.random.categorical``: a uniform, two logs
    and a comparison per id) this costs one pass of sums: 0.03 against 0.29 ms a draw over
    SmolLM2's 49,152 ids inside a compiled loop (docs/benchmarks.md). The law is the same;
    the token a given key draws is not.

    Args:
      key: PRNG key (one for all rows).
      weights: [..., V] float, >= 0, not necessarily normalised.
    """
    blocks, block_sum, block_cum = _blocks(weights)
    threshold = jax.random.uniform(key, block_cum.shape[:-1]) * block_cum[..., -1]
    return _search(blocks, block_sum, block_cum, threshold)


def _blocks(weights: Array) -> tuple[Array, Array, Array]:
    """weights [..., V] as (blocks [..., NB, DRAW_BLOCK] zero-padded, their sums [..., NB],
    and the running sums of those [..., NB])."""
    *lead, v = weights.shape
    w = weights.astype(jnp.float32)
    pad = (-v) % DRAW_BLOCK
    if pad:
        w = jnp.pad(w, [(0, 0)] * len(lead) + [(0, pad)])
    blocks = w.reshape(*lead, -1, DRAW_BLOCK)
    block_sum = jnp.sum(blocks, axis=-1)
    return blocks, block_sum, jnp.cumsum(block_sum, axis=-1)


def _search(blocks: Array, block_sum: Array, block_cum: Array, threshold: Array) -> Array:
    """The id whose running sum first passes ``threshold`` [...] (see :func:`draw`)."""
    b = _first_past(block_cum, block_sum, threshold)
    # The running sum before block b, read from block_cum itself (0, then block_cum shifted
    # by one): threshold >= it exactly, so the remainder is >= 0 (block_cum[b] -
    # block_sum[b] can round above it, and a negative remainder would pick the block's
    # first id whatever its weight).
    starts = jnp.pad(block_cum[..., :-1], [(0, 0)] * (block_cum.ndim - 1) + [(1, 0)])
    before = jnp.take_along_axis(starts, b[..., None], axis=-1)[..., 0]
    row = jnp.take_along_axis(blocks, b[..., None, None], axis=-2)[..., 0, :]
    j = _first_past(jnp.cumsum(row, axis=-1), row, threshold - before)
    return (b * DRAW_BLOCK + j).astype(jnp.int32)


def _first_past(cum: Array, part: Array, threshold: Array) -> Array:
    """The first index whose running sum ``cum`` [..., N] exceeds ``threshold`` [...], moved
    to the next index of positive ``part`` at or after it, else the last one (0 if none).

    XLA may compute a cumsum as a tree of partial sums (an associative scan), so a running
    sum can step up by a rounding error where ``part`` is 0; moving to a positive part
    keeps every id of zero weight undrawn whatever the association.
    """
    n = cum.shape[-1]
    i = jnp.arange(n, dtype=jnp.int32)
    first = jnp.sum(cum <= threshold[..., None], axis=-1, dtype=jnp.int32)
    positive = part > 0
    after = jnp.min(jnp.where(positive & (i >= first[..., None]), i, n), axis=-1)
    last = jnp.max(jnp.where(positive, i, 0), axis=-1)
    return jnp.where(after < n, after, last)


def categorical(key: Array, logits: Array) -> Array:
    """One draw per row from softmax(logits): [..., V] -> [...] int32, through :func:`draw`.

    -inf logits are never drawn unless every logit of the row is -inf (then id 0). A row
    whose largest logit is +inf draws among its +inf ids alike.
    """
    top = jnp.max(logits, axis=-1, keepdims=True)
    weights = jnp.where(jnp.isposinf(top), (logits == jnp.inf).astype(jnp.float32),
                        jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0)))
    return draw(key, weights)


def sample(key: Array, logits: Array, s: StaticSampling, temperature: Array,
           top_p: Array) -> Array:
    """One token per row. logits: [B, V] -> [B] int32."""
    if s.greedy:
        return first_argmax(logits)
    return categorical(key, filter_logits(logits, s, temperature, top_p))
