"""FR-Spec's frequency-ranked shortlist, and its position-aware budget (PA-FR).

FR-Spec drafts over the ``N`` most frequent tokens of a corpus: the head's rows for those
tokens are gathered once into a dense ``[N, d]`` sub-matrix, so each draft step is a plain
GEMM over ``N`` rows instead of ``V``. PA-FR (DynaSpec, appendix A.1) gives draft step t
the top ``K_fr(t)`` of the same ranking: ``k_max`` for t in {0, 1}, ``k_max // (t + 1)``
after. Because every budget is a prefix of one ranking, each step reads a static prefix of
the same sub-matrix (stored in blocks cut at the budgets): no gather at draft time.

Invariant: ``ids`` lists the always-kept tokens (EOS, chat-template specials) first, then
the rest by decreasing frequency, so every prefix, however short, can end a sequence.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from jax import Array

from specjax import pytree
from specjax.kernels.cpu_rowdot import head_product
from specjax.vocab.head import Candidates


def pa_fr_budget(k_max: int, step: int) -> int:
    """K_fr(t) of DynaSpec appendix A.1: ``k_max`` for t <= 1, then ``k_max // (t + 1)``."""
    return k_max if step <= 1 else k_max // (step + 1)


# Draft steps whose PA-FR budget gets its own weight block (later steps slice a block).
PA_STEPS = 16


def _block_ends(k_max: int, n: int, position_aware: bool) -> tuple[int, ...]:
    """Row ends of the weight blocks: every budget of steps 0..PA_STEPS-1, ascending."""
    if not position_aware:
        return (min(k_max, n),)
    return tuple(sorted({max(1, min(pa_fr_budget(k_max, t), n)) for t in range(PA_STEPS)}))


@pytree.dataclass
class FrequencyHead:
    """Frequency-ranked shortlist head (FR-Spec; PA-FR when ``position_aware``).

    ids: [N] int32 shortlist, always-kept tokens first, then by decreasing frequency.
    w_blocks: the target head's rows for ``ids`` (built once, see :func:`frequency_head`),
      cut at the PA-FR budgets: block i holds rows [ends[i-1], ends[i]). A step scores the
      blocks of its prefix and concatenates: XLA:CPU copies a sliced weight operand before
      a dot (measured 2.2x slower for a 10,922-row prefix), separate arrays it reads in place.
    k_max: static budget at steps 0 and 1 (the whole list for plain FR-Spec).
    """

    ids: Array
    w_blocks: tuple[Array, ...]
    k_max: int = pytree.static_field()
    position_aware: bool = pytree.static_field(default=False)
    uses_context: ClassVar[bool] = False
    stateful: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return f"{'pafr' if self.position_aware else 'fr'}:{self.k_max}"

    def capacity(self, step: int) -> int:
        k = pa_fr_budget(self.k_max, step) if self.position_aware else self.k_max
        return max(1, min(k, self.ids.shape[0]))

    def __call__(self, w, h, step, context=None, state=None) -> Candidates:
        c = self.capacity(step)
        parts, start = [], 0
        for block in self.w_blocks:
            if start >= c:
                break
            take = block if start + block.shape[0] <= c else block[: c - start]
            parts.append(head_product(h, take))
            start += block.shape[0]
        logits = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
        ids = jnp.broadcast_to(self.ids[:c], logits.shape)
        return Candidates(ids, jnp.ones(logits.shape, bool), logits)

    def split_rows(self, multiple: int) -> FrequencyHead:
        """The same head with its blocks re-cut at multiples of ``multiple`` rows, so that a
        model axis of that size splits every block evenly (:func:`specjax.sharding.shard_head`;
        PA-FR's budgets, e.g. 10,922 rows, divide by nothing).

        Blocks are a storage layout only: every step scores the same rows in the same
        order, so the candidates are unchanged; a budget that falls inside a block slices it.
        """
        n = self.ids.shape[0]
        w = self.w_blocks[0] if len(self.w_blocks) == 1 else jnp.concatenate(self.w_blocks)
        cuts = {e - e % multiple for e in _block_ends(self.k_max, n, self.position_aware)}
        ends = sorted((cuts - {0}) | {n})
        blocks = tuple(w[a:b] for a, b in zip((0, *ends[:-1]), ends, strict=True))
        return dataclasses.replace(self, w_blocks=blocks)


def frequency_order(ranked: np.ndarray, always: np.ndarray | list[int]) -> np.ndarray:
    """``always`` first (in the given order), then ``ranked`` without them: [N'] int32."""
    always = np.asarray(always, np.int64).reshape(-1)
    ranked = np.asarray(ranked, np.int64).reshape(-1)
    rest = ranked[~np.isin(ranked, always)]
    return np.concatenate([np.unique(always) if always.size else always, rest]).astype(np.int32)


def frequency_head(w: Array, ranked: np.ndarray, always: list[int], k_max: int, *,
                   position_aware: bool = False) -> FrequencyHead:
    """Build a :class:`FrequencyHead` from a ranking and the target head ``w`` [V, d].

    ranked: token ids by decreasing corpus frequency (a whole ranking or a shortlist);
      only its first ``k_max`` entries (after the always-kept tokens) are kept.
    always: ids every shortlist must hold (EOS, chat-template specials).
    """
    v = w.shape[0]
    order = frequency_order(ranked, always)
    if order.size and (order.min() < 0 or order.max() >= v):
        raise ValueError(f"frequency list has ids outside the target's vocabulary [0, {v}); "
                         "was it built for another tokenizer?")
    if len(set(order.tolist())) != order.size:
        raise ValueError("frequency list has duplicate ids; rebuild it with "
                         "`specjax build-shortlist`")
    if k_max < len(always):
        raise ValueError(f"budget {k_max} cannot hold the {len(always)} always-kept tokens "
                         f"(EOS and chat specials)")
    if k_max > order.size:
        raise ValueError(f"budget {k_max} exceeds the frequency list's {order.size} tokens; "
                         f"build a longer list (`specjax build-shortlist --sizes {k_max}`)")
    ids = jnp.asarray(order[:k_max])
    w_sub = jnp.take(w, ids, axis=0)
    ends = _block_ends(k_max, k_max, position_aware)
    blocks = tuple(w_sub[a:b] for a, b in zip((0, *ends[:-1]), ends, strict=True))
    return FrequencyHead(ids=ids, w_blocks=blocks, k_max=k_max, position_aware=position_aware)
