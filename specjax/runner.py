"""One request through the vanilla or the speculative loop: compiled, eager or streamed.

A :class:`Request` is a batch of prompts laid out for the compiled programs (bucketed
shapes, the run's :class:`~specjax.loop.Limits`, the key). A runner turns it into a loop
state (``prefill``), then either runs the whole ``lax.while_loop`` (``run``) or one step
at a time from Python (``step``: eager mode and :func:`specjax.stream`). Both paths call
the same step function, so their tokens are identical.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode import DecodeState, decode_loop, decode_step_jit, prefill
from specjax.drafter import in_target_layout
from specjax.loaded import Drafter, Target
from specjax.loop import Limits, bucket
from specjax.sampling import SamplingConfig
from specjax.speculative import (
    SpecConfig,
    SpecState,
    TreeSpec,
    cache_capacity,
    draft_phase_jit,
    spare_rows,
    spec_loop,
    spec_prefill,
    verify_phase_jit,
)
from specjax.vocab.head import VocabHead


@dataclasses.dataclass(frozen=True)
class Request:
    """A batch of prompts laid out for the compiled programs.

    prompt: [B, P] int32 right-padded to the bucket P; prompt_lens: [B] int32.
    out_len: N output slots (the bucket of max_new_tokens); capacity: cache rows.
    """

    prompt: jax.Array
    prompt_lens: jax.Array
    limits: Limits
    key: jax.Array
    out_len: int
    capacity: int

    @classmethod
    def build(cls, target: Target, ids: list[list[int]], *, max_new_tokens: int,
              sampling: SamplingConfig, stop_on_eos: bool, key: jax.Array,
              tree: TreeSpec | None) -> Request:
        """Lay out token-id prompts; ValueError when one does not fit the model's context."""
        longest = max(map(len, ids))
        spare = spare_rows(tree)
        if longest + max_new_tokens + spare > target.cfg.max_position_embeddings:
            raise ValueError(
                f"prompt of {longest} tokens + max_new_tokens={max_new_tokens}"
                f"{'' if tree is None else f' + a {spare}-node draft tree'} exceeds the "
                f"model's context of {target.cfg.max_position_embeddings}; shorten the "
                "prompt or lower max_new_tokens")
        prompt = np.zeros((len(ids), bucket(longest)), np.int32)
        for i, p in enumerate(ids):
            prompt[i, : len(p)] = p
        dyn = sampling.dynamic()
        limits = Limits(
            eos_ids=jnp.asarray(target.eos_ids if stop_on_eos else [-2], jnp.int32),
            max_new=jnp.full((len(ids),), max_new_tokens, jnp.int32),
            temperature=dyn["temperature"], top_p=dyn["top_p"])
        return cls(prompt=jnp.asarray(prompt), prompt_lens=jnp.asarray([len(p) for p in ids]),
                   limits=limits, key=key, out_len=bucket(max_new_tokens),
                   capacity=cache_capacity(longest, max_new_tokens, tree))


class Runner(Protocol):
    """Drives one loop. ``state.output`` is the :class:`specjax.loop.Output` of any state."""

    def prefill(self, req: Request) -> Any:
        """The state after the prompt's forward: the first token committed per row."""
        ...

    def run(self, state: Any) -> Any:
        """Steps until every row is done (the compiled ``lax.while_loop``)."""
        ...

    def step(self, state: Any) -> Any:
        """One step (eager mode: a target forward, or a draft and a verification)."""
        ...

    def stats(self, state: Any) -> dict[str, Any]:
        """What the loop counted (e.g. speculative steps and accepted drafts); may be empty."""
        ...


@dataclasses.dataclass
class VanillaRunner:
    """Plain decoding: one target forward per token."""

    target: Target
    sampling: SamplingConfig

    def prefill(self, req: Request) -> DecodeState:
        return prefill(self.target.params, self.target.cfg, req.prompt, req.prompt_lens,
                       req.limits, req.key, sampling=self.sampling.static(),
                       out_len=req.out_len, capacity=req.capacity)

    def run(self, state: DecodeState) -> DecodeState:
        return decode_loop(self.target.params, self.target.cfg, state,
                           sampling=self.sampling.static())

    def step(self, state: DecodeState) -> DecodeState:
        return decode_step_jit(self.target.params, self.target.cfg, state,
                               sampling=self.sampling.static())

    def stats(self, state: DecodeState) -> dict[str, Any]:
        return {}


@dataclasses.dataclass
class SpecRunner:
    """Speculative decoding; ``step`` times its draft and verify phases apart."""

    target: Target
    drafter: Drafter
    head: VocabHead
    spec: SpecConfig
    draft_s: float = 0.0
    verify_s: float = 0.0

    @classmethod
    def of(cls, target: Target, drafter: Drafter, head: VocabHead, tree: TreeSpec,
           sampling: SamplingConfig, assume_q_one: bool = False,
           attention: str = "dense") -> SpecRunner:
        # The drafter's layers as the target's (rowdot); computed once per params object.
        drafter = dataclasses.replace(drafter,
                                      params=in_target_layout(drafter.params, target.params))
        return cls(target, drafter, head,
                   SpecConfig(cfg=target.cfg, drafter=drafter.cfg, tree=tree,
                              sampling=sampling.static(), assume_q_one=assume_q_one,
                              attention=attention))

    # A stateful head's state to start the next request from (EvoSpec's buffer kept across
    # requests); None starts from ``head.init_state``.
    vocab_state: Any = None

    def prefill(self, req: Request) -> SpecState:
        vocab = None
        if self.head.stateful:
            vocab = (self.head.init_state(req.prompt.shape[0]) if self.vocab_state is None
                     else self.vocab_state)
        return spec_prefill(self.target.params, self.drafter.params, req.prompt,
                            req.prompt_lens, req.limits, req.key, vocab, spec=self.spec,
                            out_len=req.out_len, capacity=req.capacity)

    def run(self, state: SpecState) -> SpecState:
        return spec_loop(self.target.params, self.drafter.params, self.head, state,
                         spec=self.spec)

    def step(self, state: SpecState) -> SpecState:
        p, dp = self.target.params, self.drafter.params
        ta = time.perf_counter()
        draft, state = jax.block_until_ready(draft_phase_jit(p, dp, self.head, state,
                                                             spec=self.spec))
        tb = time.perf_counter()
        state = jax.block_until_ready(verify_phase_jit(p, dp, self.head, state, draft,
                                                       spec=self.spec))
        self.draft_s += tb - ta
        self.verify_s += time.perf_counter() - tb
        return state

    def stats(self, state: SpecState) -> dict[str, Any]:
        st = state.stats
        steps = np.asarray(st.steps)
        lens = np.asarray(st.accept_lens)
        accept = [lens[b, : steps[b]].tolist() for b in range(len(steps))]
        flat = [n for row in accept for n in row]
        forwards = max(int(steps.sum()), 1)
        return {"accept_lengths": accept, "target_forwards": int(steps.sum()),
                "mean_accepted_length": float(np.mean(flat)) if flat else 0.0,
                "vocab": self.head.name,
                "mean_shortlist_size": float(np.sum(st.shortlist_size) / forwards),
                "shortlist_coverage": float(np.sum(st.shortlist_hits) / forwards),
                "mean_tree_size": float(np.sum(st.tree_nodes) / forwards),
                "mean_drafter_calls": float(np.sum(st.drafter_calls) / forwards),
                "chained_fraction": float(np.sum(st.chained_steps) / forwards),
                "tree": dataclasses.asdict(self.spec.tree),
                **(self.head.summary(state.vocab) if self.head.stateful else {})}


def all_done(state: Any) -> bool:
    """Whether every row of a loop state has finished (a host sync)."""
    return bool(jnp.all(state.output.done))
