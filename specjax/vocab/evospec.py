"""EvoSpec's evolving vocabulary: a static core plus a dynamic buffer kept by ARC.

The drafter scores ``|core| + N_dyn`` rows at every draft step: the FR-Spec core (the
``N_static`` most frequent tokens, always-kept tokens first) and this row's dynamic
buffer (:mod:`specjax.vocab.arc`). After each verification the head observes the step:

* **Trigger.** An OOV event is a committed token outside the active vocabulary. Accepted
  drafts come from the head, so only the target's bonus token can be OOV.
* **Recall.** The requests are, in order: the OOV token itself, the target's top-``k``
  at the rejection step (the bonus position), and up to ``fanout`` successors of each of
  those in a token co-occurrence graph (:mod:`specjax.vocab.cooccurrence`). Duplicates
  and core tokens are dropped; ARC inserts at most ``max_insert`` new ids.

  The paper also adds the top-10 maximum-inner-product neighbours of the target-side
  hidden state among the LM-head rows (HNSW). With the verification's final hidden state
  as the query, the exact MIPS top-k *is* the target's top-k logits, so on device that
  set is already here at no cost; an approximate index only returns a subset of it.
* **Use.** A committed token found in the buffer is an ARC hit (T1 -> T2), so the buffer
  keeps what the text reuses, not only what was retrieved.

All of it runs inside the compiled loop on fixed-shape arrays (``SpecState.vocab``): no
host round trip per step, and the update runs under ``lax.cond`` only on steps where a
row had an OOV event.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from specjax import pytree
from specjax.kernels.cpu_rowdot import head_product
from specjax.vocab.arc import EMPTY, ArcConfig, ArcState, observe_event, touch
from specjax.vocab.fr_head import frequency_head
from specjax.vocab.head import Candidates, Feedback, masked


@pytree.dataclass
class EvoSpecState:
    """Per-row state: the ARC buffer [B, ...] and decoding steps taken [B] int32."""

    arc: ArcState
    step: Array


def first_occurrences(ids: Array) -> Array:
    """[..., R] bool: entries that are not EMPTY and not repeated earlier in their row."""
    r = ids.shape[-1]
    earlier = jnp.tril(jnp.ones((r, r), bool), k=-1)  # [i, j]: j < i
    dup = jnp.any((ids[..., :, None] == ids[..., None, :]) & earlier, axis=-1)
    return (ids != EMPTY) & ~dup


@pytree.dataclass
class EvoSpecHead:
    """Static core + per-row dynamic buffer (EvoSpec).

    core_ids: [N] int32 the FR-Spec core, always-kept tokens first.
    core_w: [N, d] the target head's rows for ``core_ids`` (gathered once).
    in_core: [V] bool membership of the core.
    successors: [V, S] int32 co-occurrence successors by decreasing p(v|u), EMPTY-padded
      (S = 0: no graph).
    """

    core_ids: Array
    core_w: Array
    in_core: Array
    successors: Array
    arc: ArcConfig = pytree.static_field()
    recall_k: int = pytree.static_field(default=10)
    uses_context: ClassVar[bool] = False
    stateful: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return f"evospec:{self.core_ids.shape[0]}+{self.arc.capacity}"

    def capacity(self, step: int) -> int:
        return self.core_ids.shape[0] + self.arc.capacity

    def __call__(self, w, h, step, context=None, state=None) -> Candidates:
        # h [B, K, d]; every node of a row shares the row's buffer.
        dyn = state.arc.ids  # [B, D]
        w_dyn = jnp.take(w, jnp.maximum(dyn, 0), axis=0)  # [B, D, d]
        core = head_product(h, self.core_w)
        extra = jnp.einsum("bkd,bnd->bkn", h, w_dyn, preferred_element_type=jnp.float32)
        shape = core.shape[:2]
        ids = jnp.concatenate([jnp.broadcast_to(self.core_ids, shape + self.core_ids.shape),
                               jnp.broadcast_to(dyn[:, None, :], shape + dyn.shape[1:])], -1)
        valid = jnp.concatenate([jnp.ones(core.shape, bool),
                                 jnp.broadcast_to((dyn != EMPTY)[:, None, :], extra.shape)], -1)
        return masked(ids, valid, jnp.concatenate([core, extra], -1))

    def init_state(self, batch: int) -> EvoSpecState:
        return EvoSpecState(arc=ArcState.empty(self.arc, batch),
                            step=jnp.zeros((batch,), jnp.int32))

    def requests(self, fb: Feedback) -> Array:
        """[B, R] the ids an OOV event requests, in order (EMPTY where dropped)."""
        top = jax.lax.top_k(fb.logits, self.recall_k)[1].astype(jnp.int32)  # [B, k]
        seeds = jnp.concatenate([fb.bonus[:, None], top], axis=1)  # [B, 1 + k]
        succ = jnp.take(self.successors, seeds, axis=0).reshape(seeds.shape[0], -1)
        ids = jnp.concatenate([seeds, succ], axis=1)
        keep = first_occurrences(ids) & ~jnp.take(self.in_core, jnp.maximum(ids, 0))
        return jnp.where(keep, ids, EMPTY)

    def is_active(self, state: EvoSpecState, tokens: Array) -> Array:
        """[B] bool: whether each row's ``tokens`` [B] is in its active vocabulary."""
        return self.in_core[tokens] | jnp.any(state.arc.ids == tokens[:, None], axis=1)

    def observe(self, state: EvoSpecState, fb: Feedback) -> EvoSpecState:
        live = fb.live
        step = state.step + live
        touched = jax.vmap(touch)(state.arc, fb.committed)
        arc = jax.tree.map(lambda a, b: _rows(live, a, b), touched, state.arc)
        event = live & ~self.is_active(state, fb.bonus)

        def update(arc: ArcState) -> ArcState:
            new = jax.vmap(lambda s, c, t: observe_event(s, c, t, self.arc))(
                arc, self.requests(fb), step)
            return jax.tree.map(lambda a, b: _rows(event, a, b), new, arc)

        arc = jax.lax.cond(jnp.any(event), update, lambda a: a, arc)
        return EvoSpecState(arc=arc, step=step)

    def summary(self, state: EvoSpecState) -> dict[str, Any]:
        a = jax.tree.map(np.asarray, state.arc)
        return {"oov_events": a.events.tolist(), "insertions": a.insertions.tolist(),
                "evictions": a.evictions.tolist(),
                "buffer_occupancy": np.sum(a.ids != EMPTY, axis=-1).tolist()}


def _rows(mask: Array, new: Array, old: Array) -> Array:
    """``new`` where the row ``mask`` [B] holds, else ``old`` (any trailing shape)."""
    return jnp.where(mask.reshape(mask.shape + (1,) * (new.ndim - 1)), new, old)


def evospec_head(w: Array, ranked: np.ndarray, always: list[int], n_static: int, *,
                 n_dyn: int = 256, successors: np.ndarray | None = None, fanout: int = 8,
                 recall_k: int = 10, arc: ArcConfig | None = None) -> EvoSpecHead:
    """Build an :class:`EvoSpecHead` over the target head ``w`` [V, d].

    ranked: token ids by decreasing corpus frequency (the FR-Spec ranking).
    always: ids the core must hold (EOS, chat-template specials).
    successors: [V, S] co-occurrence successors (``load_graph``); only the first
      ``fanout`` of each are requested. None: no graph.
    arc: ARC settings (default: the paper's, scaled to ``n_dyn``: ghosts of ``n_dyn``,
      p starting at ``n_dyn // 2``).
    """
    v = w.shape[0]
    # The core is FR-Spec's shortlist: the same ranking, checks and gathered rows.
    fr = frequency_head(w, ranked, always, n_static)
    if n_dyn < 1 or n_static + n_dyn > v:
        raise ValueError(f"the dynamic buffer needs 1 <= N_dyn <= V - N_static = "
                         f"{v - n_static}, got {n_dyn}")
    if not 1 <= recall_k <= v:
        raise ValueError(f"recall_k must be in [1, {v}], got {recall_k}")
    in_core = np.zeros(v, bool)
    in_core[np.asarray(fr.ids)] = True
    if successors is None:
        successors = np.zeros((v, 0), np.int32)
    successors = np.asarray(successors, np.int32)
    if successors.shape[0] != v:
        raise ValueError(f"the co-occurrence graph has {successors.shape[0]} rows, the "
                         f"target's vocabulary {v}; build it for this tokenizer")
    if arc is None:
        arc = ArcConfig(capacity=n_dyn, ghost=n_dyn, p_init=n_dyn // 2)
    elif arc.capacity != n_dyn:
        raise ValueError(f"ARC capacity {arc.capacity} differs from N_dyn={n_dyn}")
    return EvoSpecHead(core_ids=fr.ids, core_w=fr.w_blocks[0], in_core=jnp.asarray(in_core),
                       successors=jnp.asarray(successors[:, :fanout]), arc=arc,
                       recall_k=recall_k)
