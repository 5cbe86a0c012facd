"""FR-Spec's frequency-ranked shortlist, and its position-aware budget (PA-FR).

FR-Spec drafts over the ``N`` most frequent tokens of a corpus: the head's rows for those
tokens are gathered once into a dense ``[N, d]`` sub-matrix, so each draft step is a plain
GEMM over ``N`` rows instead of ``V``. PA-FR (DynaSpec, appendix A.1) gives draft step t
the top ``K_fr(t)`` of the same ranking: ``k_max`` for t in {0, 1}, ``k_max // (t + 1)``
after. Because every budget is a prefix of one ranking, each step is a static slice of
the same sub-matrix: no gather at draft time.

Invariant: ``ids`` lists the always-kept tokens (EOS, chat-template specials) first, then
the rest by decreasing frequency, so every prefix, however short, can end a sequence.
"""

from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from jax import Array

from specjax.vocab.head import Candidates, head_dataclass


def pa_fr_budget(k_max: int, step: int) -> int:
    """K_fr(t) of DynaSpec appendix A.1: ``k_max`` for t <= 1, then ``k_max // (t + 1)``."""
    return k_max if step <= 1 else k_max // (step + 1)


@head_dataclass(data=["ids", "w_sub"], meta=["k_max", "position_aware"])
class FrequencyHead:
    """Frequency-ranked shortlist head (FR-Spec; PA-FR when ``position_aware``).

    ids: [N] int32 shortlist, always-kept tokens first, then by decreasing frequency.
    w_sub: [N, d] the target head's rows for ``ids`` (built once, see :func:`frequency_head`).
    k_max: static budget at steps 0 and 1 (the whole list for plain FR-Spec).
    """

    ids: Array
    w_sub: Array
    k_max: int
    position_aware: bool = False
    uses_context: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return f"{'pafr' if self.position_aware else 'fr'}:{self.k_max}"

    def capacity(self, step: int) -> int:
        k = pa_fr_budget(self.k_max, step) if self.position_aware else self.k_max
        return max(1, min(k, self.ids.shape[0]))

    def __call__(self, w, h, step, context=None) -> Candidates:
        c = self.capacity(step)
        logits = jnp.einsum("...d,cd->...c", h, self.w_sub[:c],
                            preferred_element_type=jnp.float32)
        ids = jnp.broadcast_to(self.ids[:c], logits.shape)
        return Candidates(ids, jnp.ones(logits.shape, bool), logits)


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
    return FrequencyHead(ids=ids, w_sub=jnp.take(w, ids, axis=0), k_max=k_max,
                         position_aware=position_aware)
