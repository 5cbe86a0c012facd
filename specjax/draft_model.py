"""The drafter seam: what the speculative loop asks of any drafter.

EAGLE-1/2 (:class:`specjax.drafter.DrafterConfig`) and EAGLE-3
(:class:`specjax.eagle3.Eagle3Config`) differ in what they read from the target (its
final-norm hidden state, or three fused intermediate layers) and in their head (the
target's LM head, or their own draft vocabulary); the loop sees neither difference. It
calls, on the drafter's static config:

* ``tap_layers(target_cfg)``: target layers whose outputs the drafter reads (``()``: the
  final-norm hidden state only). Prefill and verification ask the target for them.
* ``target_features(params, hidden, taps)``: the drafter's input feature at each position
  the target ran, [B, T, width]. The root of a draft tree reads the feature of the token
  before it; deeper nodes read their parent's drafter output instead.
* ``forward(params, embed, tokens, features, positions, cache, block_mask, write_rows,
  attention_impl)``: the drafter over a block of rows (a prefill, one tree level, or the
  catch-up).
* ``init_cache(batch, capacity, dtype)``: its own KV cache.
* ``router_context(embed, tokens, features)``: the input a context-reading vocabulary head
  (DynaSpec's router) sees, or None when the drafter offers none.
* ``check_target(target_cfg)``: refuse a target of another shape.

The catch-up is the same for every drafter: after verification, the accepted drafts are
re-read through ``forward`` with ``target_features`` of the target's own states, and the
bonus token (the next root) after them in the same call, whose output the next step's root
expansion reads instead of running the drafter again.
"""

from __future__ import annotations

from typing import Any, Protocol

from jax import Array

from specjax.config import ModelConfig
from specjax.model import KVCache


class DraftModel(Protocol):
    """A drafter's static config (hashable: part of the compiled program)."""

    kind: str  # "eagle" (EAGLE-1/2) or "eagle3"

    @property
    def width(self) -> int:
        """d, the width of the drafter's features and outputs."""
        ...

    def tap_layers(self, target_cfg: ModelConfig) -> tuple[int, ...]: ...

    def target_features(self, params: Any, hidden: Array,
                        taps: tuple[Array, ...]) -> Array: ...

    def forward(self, params: Any, embed: Array, tokens: Array, features: Array,
                positions: Array, cache: KVCache, block_mask: Array | None = None,
                write_rows: Array | None = None,
                attention_impl: str = "dense") -> tuple[Array, KVCache]: ...

    def init_cache(self, batch: int, capacity: int, dtype: Any) -> KVCache: ...

    def router_context(self, embed: Array, tokens: Array, features: Array) -> Array | None: ...

    def check_target(self, cfg: ModelConfig, what: str = "drafter") -> None: ...
