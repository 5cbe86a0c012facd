"""The ``VocabHead`` seam: which tokens the drafter's head scores at each draft step.

Every draft step asks a head for a fixed-capacity buffer of candidates: real token ids,
a validity mask and logits (``-inf`` where invalid). Tree builders and verification work
in real token ids, and the target always verifies over the full vocabulary, so a head
changes the draft's quality and cost, never the output's correctness.

A head is a registered pytree: its arrays (shortlists, pre-gathered weights, router
parameters, cluster tables) are leaves that travel into ``jax.jit`` as arguments; its
configuration (budgets, capacities) is static metadata, hashed into the compiled program.
``capacity(step)`` is static, so a position-aware budget gives each draft step its own
buffer size, and a smaller buffer is a smaller GEMM.

Adding a method means adding one implementation of :class:`VocabHead`.

A head may also be *stateful* (EvoSpec's dynamic buffer): then the loop keeps the head's
per-row state in ``SpecState.vocab``, hands it to every call, and after each
verification passes it through ``observe`` with the step's :class:`Feedback`. The state
is a fixed-shape pytree, so the compiled ``lax.while_loop`` carries it like the caches.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar, Protocol

import jax.numpy as jnp
from jax import Array

from specjax import pytree
from specjax.kernels.cpu_rowdot import head_product

NEG_INF = -jnp.inf


@pytree.dataclass
class Candidates:
    """A head's answer for ``B x K`` expanded nodes with capacity ``C``.

    ids: [B, K, C] int32 real token ids; distinct among the valid entries of a row.
    valid: [B, K, C] bool; invalid entries are padding and are never drafted.
    logits: [B, K, C] float32 drafter logits; ``-inf`` exactly where not ``valid``.
    """

    ids: Array
    valid: Array
    logits: Array


@pytree.dataclass
class Feedback:
    """What one verification tells a stateful head, per row.

    committed: [B, T] int32 the step's committed tokens, left-aligned; -1 past ``count``.
    bonus: [B] int32 the target's own token (the accepted drafts came from the head; the
      bonus is the only committed token the head may not have offered).
    logits: [B, V] float32 the target's logits at the bonus position (the rejection step).
    hidden: [B, d] the target's final hidden state there (the query of a retrieval).
    live: [B] bool rows that took this step.
    """

    committed: Array
    bonus: Array
    logits: Array
    hidden: Array
    live: Array


class VocabHead(Protocol):
    """One vocabulary method. Implementations are pytree dataclasses.

    ``uses_context`` says whether ``__call__`` reads ``context``
    ([B, K, 2d] = [embedding(x_t); drafter input feature], the drafter fc's input, which
    does not depend on the drafter layer's output for this step); the draft loop only
    builds it for heads that do.

    ``stateful`` heads also define ``init_state(batch) -> S``, ``observe(S, Feedback) -> S``
    and ``summary(S) -> dict`` (statistics); their ``__call__`` gets the state as
    ``state``. Stateless heads get ``state=None``.
    """

    name: str
    uses_context: bool
    stateful: bool

    def capacity(self, step: int) -> int:
        """C, the static buffer size at draft step ``step`` (0 = first drafted token)."""
        ...

    def __call__(self, w: Array, h: Array, step: int, context: Array | None = None,
                 state: Any = None) -> Candidates:
        """Candidates for drafter hidden states ``h`` [B, K, d].

        w: [V, d] the target's LM head (rows are vocabulary entries).
        step: static draft step t of the children being drafted.
        state: a stateful head's per-row state (``SpecState.vocab``); None otherwise.
        """
        ...


def masked(ids: Array, valid: Array, logits: Array) -> Candidates:
    """Candidates with ``-inf`` logits (and id 0) where invalid; logits cast to float32."""
    return Candidates(jnp.where(valid, ids, 0).astype(jnp.int32), valid,
                      jnp.where(valid, logits.astype(jnp.float32), NEG_INF))


@pytree.dataclass
class FullHead:
    """The full vocabulary (EAGLE-2's baseline): C = V at every step."""

    vocab_size: int = pytree.static_field()
    name: ClassVar[str] = "full"
    uses_context: ClassVar[bool] = False
    stateful: ClassVar[bool] = False

    def capacity(self, step: int) -> int:
        return self.vocab_size

    def __call__(self, w, h, step, context=None, state=None) -> Candidates:
        # A frontier of 1..16 nodes takes the CPU rowdot kernel (one pass over the table).
        logits = head_product(h, w)
        ids = jnp.broadcast_to(jnp.arange(self.vocab_size, dtype=jnp.int32), logits.shape)
        return Candidates(ids, jnp.ones(logits.shape, bool), logits)


@functools.cache
def full_head(vocab_size: int) -> FullHead:
    """The drafter's head over all ``vocab_size`` ids (no shortlist)."""
    return FullHead(vocab_size)
