"""Speculative decoding: draft a tree, verify it over the full vocabulary, accept, repeat.

One step, for every batch row (``L`` = committed tokens in both caches; the root is the
last committed token: row ``L`` of the drafter cache, not yet in the target's). Each phase
is a ``jax.named_scope``, so a profile of the compiled loop shows the phases that eager
mode and ``specjax bench breakdown`` time:

1. **draft**: a tree builder (:mod:`specjax.tree`) expands the root and then
   the frontier with the drafter (:mod:`specjax.draft_model`); expanded nodes write
   drafter K/V at rows ``L + slot`` of the drafter cache. The root's own drafter row was
   run by the previous step's catch-up (or the prefill), so its expansion only asks the
   vocabulary head (:mod:`specjax.vocab`), which decides which tokens each expansion scores.
2. **verify**: the target runs all T tree nodes in one forward (positions
   ``L + depth``, the ancestor mask), writing rows ``L .. L+T-1``.
3. **accept**: :mod:`specjax.verify` picks the accepted path and a bonus token.
4. **compact**: the target cache keeps the accepted rows (:func:`compact_cache`).
5. **catch_up**: the drafter re-reads the accepted drafts with the *target's*
   features (EAGLE's catch-up), so its rows past the root need no compaction: they
   are rewritten. The same call reads the bonus, the next root, right after them: its
   output is the next step's root expansion, so a step runs the drafter's layers once
   for the catch-up and the root together.
6. **commit**: accepted drafts + bonus go to the output
   (:meth:`specjax.loop.Output.append`), cut at EOS / budget.

:func:`spec_step` is the whole step; :func:`spec_loop` runs it inside one
``lax.while_loop``; eager mode and :func:`specjax.stream` call :func:`draft_phase` and
:func:`verify_phase` from Python.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from specjax import pytree
from specjax.config import ModelConfig
from specjax.draft_model import DraftModel
from specjax.kv import compact_cache
from specjax.loop import (
    PAD,
    Limits,
    Output,
    bucket,
    in_chunks,
    last_valid,
    prefill_chunks,
    prefill_target,
    run_until_done,
    sample_first,
)
from specjax.model import KVCache, Params, forward_hidden, lm_head
from specjax.sampling import StaticSampling, target_probs
from specjax.sharding import constrain_state
from specjax.tree import DraftTree, TreeSpec
from specjax.tree.lookup import copy_bias, gate_root, graft_lookup
from specjax.verify import committed_tokens, verify_greedy, verify_sampling
from specjax.vocab.head import Feedback, VocabHead


def spare_rows(tree: TreeSpec | None) -> int:
    """Cache rows one decode step may write past the last committed token.

    Vanilla decoding writes one row; a speculative step writes every tree node (verify) and
    every drafter workspace slot (draft), and its catch-up writes rows ``L + 1`` to
    ``L + max_depth + 1`` (the accepted drafts, then the next root).
    """
    if tree is None:
        return 1
    return max(tree.num_nodes, tree.workspace, tree.max_depth + 2)


def cache_capacity(prompt_len: int, max_new_tokens: int, tree: TreeSpec | None, *,
                   spare: int | None = None) -> int:
    """Rows both caches allocate: bucketed prompt + bucketed output + :func:`spare_rows`.

    Shapes are bucketed so runs of similar lengths share one compiled program. ``spare``
    overrides the tree's spare rows (a benchmark sizing one cache for several trees).
    """
    return bucket(prompt_len) + bucket(max_new_tokens) + (
        spare_rows(tree) if spare is None else spare)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Everything static about a speculative run: a hashable jit argument."""

    cfg: ModelConfig  # the target
    drafter: DraftModel  # the drafter's config (EAGLE-1/2 or EAGLE-3)
    tree: TreeSpec
    sampling: StaticSampling
    # EAGLE's shortcut: verify every child with the point-mass rule (q treated as
    # one) even when children were sampled from q. Still exact, but it accepts
    # less often than SpecInfer/Sequoia's rule; only ever on request.
    assume_q_one: bool = False
    # Router training data (train/router_data.py): when > 0, the draft phase also
    # returns every expansion's router context and its top-``record_top_l`` candidates.
    record_top_l: int = 0
    # How tree blocks attend (the verify forward and the drafter's tree expansion):
    # "dense" (the inline masked softmax), or specjax.kernels.tree_attention's "xla",
    # "pallas" or "auto" (the Pallas kernel on a GPU, XLA elsewhere).
    attention: str = "dense"

    def __post_init__(self):
        if self.record_top_l and self.tree.skips_expansions:
            raise ValueError(f"router data (record_top_l) is recorded from every expansion; a "
                             f"{self.tree.kind} tree skips some at run time: collect with an "
                             f"eagle2, chain, static or dyspec tree")


@pytree.dataclass
class SpecStats:
    """What the steps did, per row; only live steps count.

    accept_lens: [B, N] int32 tokens committed by step i (bonus included), 0 after.
    steps: [B] int32 steps taken (target forwards).
    shortlist_size: [B] float32 sum over steps of the mean valid candidates per expansion.
    shortlist_hits: [B] int32 steps whose first committed token the root's shortlist held
      (the vocabulary head's coverage).
    tree_nodes: [B] int32 sum over steps of the valid tree nodes, root included (dynamic
      trees realise fewer than their budget).
    drafter_calls: [B] int32 sum over steps of the expansions made, the root's included (a
      dyspec-threshold tree skips the layers with nothing worth expanding). Each is one
      drafter forward: the root's is the previous step's catch-up, which reads it.
    chained_steps: [B] int32 steps whose verified tree held this row's lookup chain (0
      without one): the rest verified the smaller tree (``TreeSpec.lookup_min``).
    """

    accept_lens: Array
    steps: Array
    shortlist_size: Array
    shortlist_hits: Array
    tree_nodes: Array
    drafter_calls: Array
    chained_steps: Array

    @classmethod
    def zeros(cls, batch: int, out_len: int) -> SpecStats:
        return cls(accept_lens=jnp.zeros((batch, out_len), jnp.int32),
                   steps=jnp.zeros((batch,), jnp.int32),
                   shortlist_size=jnp.zeros((batch,), jnp.float32),
                   shortlist_hits=jnp.zeros((batch,), jnp.int32),
                   tree_nodes=jnp.zeros((batch,), jnp.int32),
                   drafter_calls=jnp.zeros((batch,), jnp.int32),
                   chained_steps=jnp.zeros((batch,), jnp.int32))


@pytree.dataclass
class SpecState:
    """Carry of the speculative loop: output + limits + both caches + root + statistics."""

    output: Output
    limits: Limits
    tcache: KVCache  # target; lengths L
    dcache: KVCache  # drafter; same lengths between steps
    root: Array  # [B] int32 last committed token: in the drafter cache (row L), not the
    # target's
    root_feat: Array  # [B, w] the drafter's input feature for the root (from the target's
    # states at the token before it; w = the drafter's width)
    root_h: Array  # [B, w] the drafter's output at the root, whose row L of dcache is
    # written: the root's expansion reads it instead of running the drafter again
    stats: SpecStats
    vocab: Any = None  # a stateful head's per-row state (EvoSpec's buffer); None otherwise
    # The prompts [B, P], PAD past each row's length, when the tree grafts a lookup chain
    # or gates the root toward a copy (both search prompt + output); None otherwise.
    prompt: Array | None = None


@pytree.dataclass
class Shortlists:
    """What one draft step's vocabulary head offered, for the coverage statistics."""

    root_ids: Array  # [B, C0] int32 the root expansion's candidates
    root_valid: Array  # [B, C0] bool
    mean_size: Array  # [B] float32 valid candidates per expanded node, averaged
    calls: Array  # [] int32 expansions (head evaluations) this step, the root's included
    # Only when SpecConfig.record_top_l > 0, one entry per expansion (step t = list index
    # for unrolled builders): (context [B, K, 2d], top-L candidate ids [B, K, L], step).
    records: tuple | None = None


@pytree.dataclass
class Draft:
    """What the draft phase hands to the verify phase."""

    tree: DraftTree
    dcache: KVCache  # the drafter cache with the tree's workspace rows written
    shortlists: Shortlists
    # With a lookup chain: the tree before the graft, and [B] bool which rows grafted one
    # (their suffix matched at least ``TreeSpec.lookup_min`` tokens); None otherwise.
    unchained: DraftTree | None = None
    chained: Array | None = None


def _row_gather(x: Array, idx: Array) -> Array:
    """x[b, idx[b, j]] for x [B, T, ...] and idx [B, J] (clipped into range)."""
    idx = jnp.clip(idx, 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


@partial(jax.jit, static_argnames=("spec", "out_len", "capacity"))
def spec_prefill(params: Params, dparams: Any, prompt: Array, prompt_lens: Array,
                 limits: Limits, key: Array, vocab: Any = None, *, spec: SpecConfig,
                 out_len: int, capacity: int) -> SpecState:
    """Prefill the target and the drafter; sample the first token (the first root).

    prompt: [B, P] right-padded; row b valid in [0, prompt_lens[b]).
    vocab: a stateful head's starting state (``head.init_state(B)``, or one kept from an
      earlier request); None for stateless heads.
    """
    b, p = prompt.shape
    dm = spec.drafter
    hidden, tcache, taps = prefill_target(params, spec.cfg, prompt, prompt_lens, capacity,
                                          dm.tap_layers(spec.cfg))
    output = sample_first(lm_head(params, last_valid(hidden, prompt_lens)), limits, key,
                          spec.sampling, out_len)
    feats = dm.target_features(dparams, hidden, taps)
    # Drafter row t reads x_t with the target feature at t-1 (zeros before x_0).
    shifted = jnp.concatenate([jnp.zeros_like(feats[:, :1]), feats[:, :-1]], axis=1)

    def run(block: tuple[Array, Array], positions: Array, dcache: Any) -> tuple[tuple, Any]:
        return (), dm.forward(dparams, params.embed, *block, positions, dcache)[1]

    dtype = params.embed.dtype
    _, dcache = in_chunks(run, (prompt, shifted), dm.init_cache(b, capacity, dtype), prompt_lens,
                          *prefill_chunks(spec.cfg, dtype, b, p, capacity))
    # The first root's drafter row (position prompt_lens), as every later root's is read by
    # the catch-up: the first draft then only asks the head.
    root, root_feat = output.tokens[:, 0], last_valid(feats, prompt_lens)
    root_h, dcache = dm.forward(dparams, params.embed, root[:, None], root_feat[:, None],
                                prompt_lens[:, None], dcache)
    return constrain_state(SpecState(
        output=output, limits=limits, tcache=tcache,
        dcache=dataclasses.replace(dcache, lengths=tcache.lengths), root=root,
        root_feat=root_feat, root_h=root_h[:, 0], stats=SpecStats.zeros(b, out_len),
        vocab=vocab,
        prompt=padded_prompt(prompt, prompt_lens) if spec.tree.reads_history else None))


def padded_prompt(prompt: Array, prompt_lens: Array) -> Array:
    """[B, P] prompts with PAD past each row's length (what a lookup chain searches)."""
    return jnp.where(jnp.arange(prompt.shape[1]) < prompt_lens[:, None], prompt, PAD)


def draft_phase(params: Params, dparams: Any, head: VocabHead, state: SpecState,
                spec: SpecConfig) -> tuple[Draft, SpecState]:
    """Build this step's draft tree with the drafter and ``head``.

    Returns the draft and the state with its key advanced (nothing else changes).
    """
    b = state.root.shape[0]
    dm = spec.drafter
    n_ws = spec.tree.workspace
    lengths = state.dcache.lengths
    node_hidden = jnp.zeros((b, n_ws, dm.width), state.root_feat.dtype)
    # The root's candidates and every expansion's router records leave through trace-time
    # lists. Only the root's call is certain to be traced outside a builder's lax.cond
    # (records are refused with trees that skip expansions, SpecConfig); the mean shortlist
    # size travels in the carry, so a skipped expansion adds nothing to it.
    root_offer, records = [], []
    if spec.tree.copy_bias:  # the root's lookup token and its bonus, [B] each
        copy = copy_bias(spec.tree, state.prompt, state.output.tokens, state.output.num_new)

    def expand(carry, tokens, depth, slot, ancestors, step):
        dcache, node_hidden, size_sum, calls = carry
        # A node's input feature is its parent's drafter output; the root's is the
        # target's. The parent is the deepest strict ancestor: the largest such slot.
        strict = ancestors & (jnp.arange(n_ws) != slot[..., None])
        parent = jnp.max(jnp.where(strict, jnp.arange(n_ws), -1), axis=-1)
        feats = jnp.where((parent < 0)[..., None], state.root_feat[:, None, :],
                          _row_gather(node_hidden, parent))
        if not root_offer:
            # Builders expand the root first, alone (K copies of it; tree.base.ExpandFn).
            # Its row L is in dcache and its output in root_h, from the catch-up.
            if step != 0:
                raise ValueError(f"a tree builder's first expansion must be the root's "
                                 f"(step 0), got step {step}")
            h = jnp.broadcast_to(state.root_h[:, None, :], feats.shape)
        else:
            h, dcache = dm.forward(dparams, params.embed, tokens, feats,
                                   lengths[:, None] + depth, dcache, block_mask=ancestors,
                                   write_rows=lengths[:, None] + slot,
                                   attention_impl=spec.attention)
        node_hidden = node_hidden.at[jnp.arange(b)[:, None], slot].set(h)
        context = (dm.router_context(params.embed, tokens, feats)
                   if head.uses_context or spec.record_top_l else None)
        cand = head(params.head, h, step, context, state.vocab)
        # Records, sizes, coverage and EvoSpec's feedback see the head's own offer; the
        # builder ranks (and samples) the root by the copy-gated one.
        drafted = cand
        if not root_offer:
            root_offer.append(cand)
            if spec.tree.copy_bias:
                drafted = gate_root(cand, h, params.head, *copy)
        if spec.record_top_l:
            top = jnp.take_along_axis(cand.ids, jax.lax.top_k(cand.logits, spec.record_top_l)[1],
                                      axis=-1)
            records.append((context, top, step))
        size = jnp.mean(jnp.sum(cand.valid, axis=-1), axis=-1).astype(jnp.float32)
        return (dcache, node_hidden, size_sum + size, calls + 1), drafted.ids, drafted.logits

    with jax.named_scope("draft"):
        output, sub = state.output.split_key()
        sampled = not spec.sampling.greedy
        carry = (state.dcache, node_hidden, jnp.zeros((b,), jnp.float32), jnp.zeros((), jnp.int32))
        tree, (dcache, _, size_sum, calls) = spec.tree.build(
            expand, carry, state.root, sub if sampled else None,
            state.limits.temperature if sampled else 0.0, spec.cfg.vocab_size)
        unchained = chained = None
        if spec.tree.lookup:
            unchained = tree
            tree, chained = graft_lookup(tree, spec.tree, state.prompt, state.output.tokens,
                                         state.output.num_new, live=~state.output.done)
        shortlists = Shortlists(root_offer[0].ids[:, 0], root_offer[0].valid[:, 0],
                                size_sum / calls.astype(jnp.float32), calls,
                                tuple(records) if spec.record_top_l else None)
    return (Draft(tree=tree, dcache=dcache, shortlists=shortlists, unchained=unchained,
                  chained=chained),
            dataclasses.replace(state, output=output))


def verify_phase(params: Params, dparams: Any, head: VocabHead, state: SpecState, draft: Draft,
                 spec: SpecConfig) -> SpecState:
    """Verify the tree with the target, accept, update both caches and the output.

    A stateful ``head`` then observes the step (:class:`~specjax.vocab.head.Feedback`).
    When the draft carries the tree without its lookup chain (``draft.unchained``), a step
    in which no row found a chain verifies that smaller tree instead (``lax.cond``: one
    branch runs), so a chain costs verify rows only where the lookup matched.
    """
    if draft.unchained is None:
        return _verify_tree(params, dparams, head, state, draft, spec, spec.tree.max_depth)
    # Without its chain the tree is the builder's, no deeper than the builder makes it: the
    # catch-up then re-reads only that many accepted drafts.
    return jax.lax.cond(
        jnp.any(draft.chained),
        lambda: _verify_tree(params, dparams, head, state, draft, spec, spec.tree.max_depth),
        lambda: _verify_tree(params, dparams, head, state,
                             dataclasses.replace(draft, tree=draft.unchained,
                                                 chained=jnp.zeros_like(draft.chained)), spec,
                             spec.tree.builder.max_depth(spec.tree)))


def _verify_tree(params: Params, dparams: Any, head: VocabHead, state: SpecState, draft: Draft,
                 spec: SpecConfig, max_depth: int) -> SpecState:
    """``max_depth``: the deepest node ``draft.tree`` can hold (static), which bounds the
    accepted path the catch-up re-reads."""
    tree = draft.tree
    b, t = tree.tokens.shape
    dm = spec.drafter
    live = ~state.output.done
    lengths = state.tcache.lengths
    limits = state.limits
    with jax.named_scope("verify"):
        hidden, tcache, taps = forward_hidden(params, spec.cfg, tree.tokens,
                                              lengths[:, None] + tree.depth, state.tcache,
                                              block_mask=tree.ancestors,
                                              tap_layers=dm.tap_layers(spec.cfg),
                                              attention_impl=spec.attention)
        logits = lm_head(params, hidden)
    with jax.named_scope("accept"):
        output, sub = state.output.split_key()
        if spec.sampling.greedy:
            acc = verify_greedy(tree.tokens, tree.parent, tree.valid, logits)
        else:
            probs = target_probs(logits, spec.sampling, limits.temperature, limits.top_p)
            acc = verify_sampling(sub, tree.tokens, tree.parent, tree.valid, probs,
                                  tree.draft_dist, sampled=tree.sampled,
                                  assume_q_one=spec.assume_q_one, fixed=tree.fixed)
        k = acc.num_accepted
        last = _row_gather(acc.path, k[:, None])[:, 0]
    with jax.named_scope("compact"):
        tcache = compact_cache(tcache, acc.path, k, t)
    with jax.named_scope("catch_up"):
        # Drafter rows L+1 .. L+k re-read the accepted drafts with the target's features,
        # and row L+k+1 reads the bonus (the next root) with the feature at the last
        # accepted node: the committed tokens after the root, each with the target's
        # feature at the token before it. Rows past k hold garbage past the new length:
        # the causal block hides them from row k, and later reads see only rows a draft
        # or catch-up has written since (model.cache_mask).
        feats = dm.target_features(dparams, hidden, taps)
        d = min(max_depth, t - 1)  # the longest path this tree can accept
        dcache = dataclasses.replace(draft.dcache, lengths=lengths + 1)
        j = jnp.arange(d + 1)
        drafts = jnp.concatenate([_row_gather(tree.tokens, acc.path[:, 1:d + 1]),
                                  acc.bonus[:, None]], axis=1)  # [B, d + 1]
        cu_tokens = jnp.where(j == k[:, None], acc.bonus[:, None], drafts)
        cu_h, dcache = dm.forward(dparams, params.embed, cu_tokens,
                                  _row_gather(feats, acc.path[:, :d + 1]),
                                  lengths[:, None] + 1 + j, dcache)
        root_h = _row_gather(cu_h, k[:, None])[:, 0]
    with jax.named_scope("commit"):
        # Accepted drafts then the bonus, cut after the first EOS and at the budget.
        toks, count = committed_tokens(tree.tokens, acc)
        output, count = output.append(toks, count, limits)
        new_len = jnp.where(live, lengths + k + 1, lengths)
        st = state.stats
        step_rows = jnp.where(live, st.steps, st.accept_lens.shape[1])
        sl = draft.shortlists
        hit = jnp.any((sl.root_ids == toks[:, :1]) & sl.root_valid, axis=-1)
        stats = SpecStats(
            accept_lens=st.accept_lens.at[jnp.arange(b), step_rows].set(count, mode="drop"),
            steps=st.steps + live,
            shortlist_size=st.shortlist_size + jnp.where(live, sl.mean_size, 0.0),
            shortlist_hits=st.shortlist_hits + (live & hit),
            tree_nodes=st.tree_nodes + jnp.where(live, jnp.sum(tree.valid, axis=1), 0),
            drafter_calls=st.drafter_calls + jnp.where(live, sl.calls, 0),
            chained_steps=st.chained_steps + (
                0 if draft.chained is None else live & draft.chained))
    vocab = state.vocab
    if head.stateful:
        with jax.named_scope("observe"):
            at = last[:, None]
            committed = jnp.where(jnp.arange(toks.shape[1]) < count[:, None], toks, -1)
            vocab = head.observe(vocab, Feedback(
                committed=committed, bonus=acc.bonus,
                logits=_row_gather(logits, at)[:, 0].astype(jnp.float32),
                hidden=_row_gather(hidden, at)[:, 0], live=live))
    # Under a mesh the carry keeps one layout from step to step (constrain_state).
    return constrain_state(SpecState(
        output=output, limits=limits,
        tcache=dataclasses.replace(tcache, lengths=new_len),
        dcache=dataclasses.replace(dcache, lengths=new_len),
        root=jnp.where(live, acc.bonus, state.root),
        root_feat=jnp.where(live[:, None], _row_gather(feats, last[:, None])[:, 0],
                            state.root_feat),
        root_h=jnp.where(live[:, None], root_h, state.root_h),
        stats=stats, vocab=vocab, prompt=state.prompt))


def spec_step(params: Params, dparams: Any, head: VocabHead, state: SpecState,
              spec: SpecConfig) -> SpecState:
    """One whole step: draft, then verify / accept / compact / catch up / commit."""
    draft, state = draft_phase(params, dparams, head, state, spec)
    return verify_phase(params, dparams, head, state, draft, spec)


@partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def spec_loop(params: Params, dparams: Any, head: VocabHead, state: SpecState, *,
              spec: SpecConfig) -> SpecState:
    """Run :func:`spec_step` until every row is done, in one ``lax.while_loop``."""
    return run_until_done(lambda s: spec_step(params, dparams, head, s, spec), state)


@partial(jax.jit, static_argnames=("spec",))
def _draft_and_output(params: Params, dparams: Any, head: VocabHead, state: SpecState, *,
                      spec: SpecConfig) -> tuple[Draft, Output]:
    # Only what the draft phase changes leaves the program: returning the whole (undonated)
    # state would copy both caches on every call (107 copies, ~4 ms a call for SmolLM2 on a
    # 2-core CPU, against ~1.5 ms for the draft itself); donating it was slower still.
    draft, state = draft_phase(params, dparams, head, state, spec)
    return draft, state.output


def draft_phase_jit(params: Params, dparams: Any, head: VocabHead, state: SpecState, *,
                    spec: SpecConfig) -> tuple[Draft, SpecState]:
    """:func:`draft_phase`, compiled, for eager callers: the draft and the state with its
    key advanced. The caches pass through on the host side, uncopied."""
    draft, output = _draft_and_output(params, dparams, head, state, spec=spec)
    return draft, dataclasses.replace(state, output=output)


verify_phase_jit = jax.jit(verify_phase, static_argnames=("spec",), donate_argnames=("state",))
spec_step_jit = jax.jit(spec_step, static_argnames=("spec",), donate_argnames=("state",))
