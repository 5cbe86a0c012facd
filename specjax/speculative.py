"""Speculative decoding: draft a tree, verify it over the full vocabulary, accept, repeat.

One step, for every batch row (``L`` = committed tokens in both caches; the
root is the last committed token, not yet cached):

1. **draft**: a tree builder (:mod:`specjax.tree`) expands the root and then
   the frontier with the drafter; expanded nodes write drafter K/V at rows
   ``L + slot`` of the drafter cache. The vocabulary head (:mod:`specjax.vocab`)
   decides which tokens each expansion scores: the full vocabulary or a shortlist.
2. **verify**: the target runs all T tree nodes in one forward (positions
   ``L + depth``, the ancestor mask), writing rows ``L .. L+T-1``.
3. **accept**: :mod:`specjax.verify` picks the accepted path and a bonus token.
4. **update**: the target cache keeps the accepted rows (:func:`compact_cache`);
   the drafter re-reads the accepted drafts with the *target's* features
   (EAGLE's catch-up), so its rows past the root need no compaction: they are
   rewritten. The bonus becomes the next root.
5. **append**: accepted drafts + bonus go to the output, cut at EOS / budget.

``spec_step`` is the whole step; ``decode_loop`` runs it inside one
``lax.while_loop``; eager mode calls :func:`draft_phase` and
:func:`verify_phase` from Python so each can be timed.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from specjax.config import ModelConfig
from specjax.decode import PAD
from specjax.drafter import DrafterConfig, DrafterParams, drafter_hidden, init_drafter_cache
from specjax.kv import compact_cache
from specjax.model import KVCache, Params, forward_hidden, init_cache, lm_head, pytree_dataclass
from specjax.sampling import StaticSampling, sample, target_probs
from specjax.tree import (
    DraftTree,
    build_chain,
    build_eagle2,
    build_static,
    eagle2_sizes,
    normalize_paths,
)
from specjax.verify import committed_tokens, verify_greedy, verify_sampling
from specjax.vocab.head import VocabHead


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """Which draft tree to build; static (it fixes every shape)."""

    kind: Literal["chain", "static", "eagle2"] = "eagle2"
    depth: int = 4  # chain length, or EAGLE-2 expansions (= deepest draft depth)
    top_k: int = 4  # EAGLE-2 beam width and children per expanded node
    total_tokens: int = 12  # EAGLE-2 draft nodes kept (root excluded)
    paths: tuple[tuple[int, ...], ...] = ()  # static trees: child-rank paths

    def __post_init__(self):
        if self.kind not in ("chain", "static", "eagle2"):
            raise ValueError(f"tree kind must be chain, static or eagle2, got {self.kind!r}")
        for name in ("depth", "top_k", "total_tokens"):  # before any size is derived from them
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"tree {name} must be an int >= 1, got {v!r}")
        if self.kind == "static":
            object.__setattr__(self, "paths", normalize_paths(self.paths))
        pool = eagle2_sizes(self.top_k, self.depth)[1]
        if self.kind == "eagle2" and self.total_tokens > pool:
            raise ValueError(f"total_tokens={self.total_tokens} exceeds the {pool} candidates "
                             f"of an EAGLE-2 tree with top_k={self.top_k}, depth={self.depth}")

    @property
    def num_nodes(self) -> int:
        """T, the tree's nodes including the root."""
        return {"chain": self.depth + 1, "static": len(self.paths) + 1,
                "eagle2": self.total_tokens + 1}[self.kind]

    @property
    def max_depth(self) -> int:
        return max(map(len, self.paths)) if self.kind == "static" else self.depth

    @property
    def workspace(self) -> int:
        """Drafter rows one tree build writes past the prefix."""
        return eagle2_sizes(self.top_k, self.depth)[0] if self.kind == "eagle2" \
            else self.num_nodes

    @property
    def samples_children(self) -> bool:
        """Whether sampling mode draws children from q (so verification may use q).

        Chain and static trees fix their shape in advance, so sampled children
        are exact draws without replacement and SpecInfer/Sequoia verification
        applies. EAGLE-2 keeps nodes by their drafted values, so its children
        are taken top-k and verified with the point-mass rule, which is exact
        for any candidate list chosen independently of the verifier's coins.
        """
        return self.kind != "eagle2"

    def build(self, expand, carry, root: Array, key: Array | None, temperature,
              vocab_size: int) -> tuple[DraftTree, object]:
        kw = dict(key=key, temperature=temperature, vocab_size=vocab_size)
        if self.kind == "chain":
            return build_chain(expand, carry, root, self.depth, **kw)
        if self.kind == "static":
            return build_static(expand, carry, root, self.paths, **kw)
        if not self.samples_children:
            kw = dict(vocab_size=vocab_size)
        return build_eagle2(expand, carry, root, top_k=self.top_k, depth=self.depth,
                            total_tokens=self.total_tokens, **kw)


@pytree_dataclass
class SpecState:
    """Carry of the speculative loop. B rows, N output slots."""

    tcache: KVCache  # target; lengths L
    dcache: KVCache  # drafter; same lengths between steps
    root: Array  # [B] int32 last committed token, in neither cache yet
    root_feat: Array  # [B, d] target feature of the token before the root
    out: Array  # [B, N] int32 new tokens, PAD after each row's end
    num_new: Array  # [B] int32
    done: Array  # [B] bool
    accept_lens: Array  # [B, N] int32 tokens committed by each step (bonus included)
    steps: Array  # [B] int32 steps taken while live
    shortlist_size: Array  # [B] float32 sum over live steps of the mean valid candidates
    shortlist_hits: Array  # [B] int32 live steps whose first committed token the root's
    # shortlist held (the vocabulary head's coverage)
    key: Array
    max_new: Array  # [] int32


@dataclasses.dataclass(frozen=True)
class Engine:
    """Everything static about a speculative run: a hashable jit argument."""

    cfg: ModelConfig
    dcfg: DrafterConfig
    tree: TreeSpec
    sampling: StaticSampling
    # EAGLE's shortcut: verify every child with the point-mass rule (q treated as
    # one) even when children were sampled from q. Still exact, but it accepts
    # less often than SpecInfer/Sequoia's rule; only ever on request.
    assume_q_one: bool = False
    # Router training data (train/router_data.py): when > 0, the draft phase also
    # returns every expansion's router context and its top-``record_top_l`` candidates.
    record_top_l: int = 0


def _is_eos(tok: Array, eos_ids: Array) -> Array:
    return jnp.any(tok[..., None] == eos_ids, axis=-1)


def _row_gather(x: Array, idx: Array) -> Array:
    """x[b, idx[b, j]] for x [B, T, ...] and idx [B, J] (clipped into range)."""
    idx = jnp.clip(idx, 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


@partial(jax.jit, static_argnames=("eng", "out_len", "capacity"))
def spec_prefill(params: Params, dparams: DrafterParams, prompt: Array, prompt_lens: Array,
                 key: Array, max_new: Array, eos_ids: Array, temperature: Array, top_p: Array,
                 *, eng: Engine, out_len: int, capacity: int) -> SpecState:
    """Prefill the target and the drafter; sample the first token (the first root).

    prompt: [B, P] right-padded; row b valid in [0, prompt_lens[b]).
    """
    b, p = prompt.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    tcache = init_cache(eng.cfg, b, capacity, params.embed.dtype)
    hidden, tcache, _ = forward_hidden(params, eng.cfg, prompt, positions, tcache)
    last = prompt_lens - 1
    last_hidden = _row_gather(hidden, last[:, None])[:, 0]
    key, sub = jax.random.split(key)
    first = sample(sub, lm_head(params, last_hidden), eng.sampling, temperature, top_p)
    # Drafter row t reads x_t with the target feature at t-1 (zeros before x_0).
    feats = jnp.concatenate([jnp.zeros_like(hidden[:, :1]), hidden[:, :-1]], axis=1)
    dcache = init_drafter_cache(eng.dcfg, b, capacity, params.embed.dtype)
    _, dcache = drafter_hidden(dparams, eng.dcfg, params.embed, prompt, feats, positions, dcache)
    lengths = prompt_lens.astype(jnp.int32)
    num_new = jnp.ones((b,), jnp.int32)
    return SpecState(
        tcache=dataclasses.replace(tcache, lengths=lengths),
        dcache=dataclasses.replace(dcache, lengths=lengths), root=first, root_feat=last_hidden,
        out=jnp.full((b, out_len), PAD, jnp.int32).at[:, 0].set(first), num_new=num_new,
        done=_is_eos(first, eos_ids) | (num_new >= max_new),
        accept_lens=jnp.zeros((b, out_len), jnp.int32), steps=jnp.zeros((b,), jnp.int32),
        shortlist_size=jnp.zeros((b,), jnp.float32),
        shortlist_hits=jnp.zeros((b,), jnp.int32), key=key, max_new=max_new)


class Shortlists(NamedTuple):
    """What one draft step's vocabulary head offered, for the coverage statistics."""

    root_ids: Array  # [B, C0] int32 the root expansion's candidates
    root_valid: Array  # [B, C0] bool
    mean_size: Array  # [B] float32 valid candidates per expanded node, averaged
    # Only when Engine.record_top_l > 0, one entry per expansion (step t = list index for
    # unrolled builders): (context [B, K, 2d], top-L candidate ids [B, K, L], step).
    records: tuple | None = None


def draft_phase(params: Params, dparams: DrafterParams, head: VocabHead, state: SpecState,
                temperature: Array, eng: Engine) -> tuple[DraftTree, KVCache, Array, Shortlists]:
    """Build this step's draft tree. Returns (tree, drafter cache, next key, shortlists)."""
    b = state.root.shape[0]
    n_ws = eng.tree.workspace
    lengths = state.dcache.lengths
    node_hidden = jnp.zeros((b, n_ws, eng.cfg.hidden_size), state.root_feat.dtype)
    offered, records = [], []  # per expansion; trace-time lists (the builders are unrolled)

    def expand(carry, tokens, depth, slot, ancestors, step):
        dcache, node_hidden = carry
        # A node's input feature is its parent's drafter output; the root's is the
        # target's. The parent is the deepest strict ancestor: the largest such slot.
        strict = ancestors & (jnp.arange(n_ws) != slot[..., None])
        parent = jnp.max(jnp.where(strict, jnp.arange(n_ws), -1), axis=-1)
        feats = jnp.where((parent < 0)[..., None], state.root_feat[:, None, :],
                          _row_gather(node_hidden, parent))
        h, dcache = drafter_hidden(dparams, eng.dcfg, params.embed, tokens, feats,
                                   lengths[:, None] + depth, dcache, block_mask=ancestors,
                                   write_rows=lengths[:, None] + slot)
        node_hidden = node_hidden.at[jnp.arange(b)[:, None], slot].set(h)
        # The router context is the drafter fc's input: it does not wait for the layer.
        context = (jnp.concatenate([params.embed[tokens].astype(feats.dtype), feats], axis=-1)
                   if head.uses_context or eng.record_top_l else None)
        cand = head(params.head, h, step, context)
        offered.append(cand)
        if eng.record_top_l:
            top = jnp.take_along_axis(cand.ids, jax.lax.top_k(cand.logits, eng.record_top_l)[1],
                                      axis=-1)
            records.append((context, top, step))
        return (dcache, node_hidden), cand.ids, cand.logits

    key, sub = jax.random.split(state.key)
    sampled = not eng.sampling.greedy
    tree, (dcache, _) = eng.tree.build(expand, (state.dcache, node_hidden), state.root,
                                       sub if sampled else None,
                                       temperature if sampled else 0.0, eng.cfg.vocab_size)
    sizes = [jnp.mean(jnp.sum(c.valid, axis=-1), axis=-1) for c in offered]
    shortlists = Shortlists(offered[0].ids[:, 0], offered[0].valid[:, 0],
                            jnp.mean(jnp.stack(sizes, axis=-1), axis=-1).astype(jnp.float32),
                            tuple(records) if eng.record_top_l else None)
    return tree, dcache, key, shortlists


def verify_phase(params: Params, dparams: DrafterParams, state: SpecState, tree: DraftTree,
                 dcache: KVCache, key: Array, shortlists: Shortlists, eos_ids: Array,
                 temperature: Array, top_p: Array, eng: Engine) -> SpecState:
    """Verify the tree with the target, accept, update both caches and the output."""
    b, t = tree.tokens.shape
    live = ~state.done
    lengths = state.tcache.lengths
    hidden, tcache, _ = forward_hidden(params, eng.cfg, tree.tokens,
                                       lengths[:, None] + tree.depth, state.tcache,
                                       block_mask=tree.ancestors)
    logits = lm_head(params, hidden)
    key, sub = jax.random.split(key)
    if eng.sampling.greedy:
        acc = verify_greedy(tree.tokens, tree.parent, tree.valid, logits)
    else:
        probs = target_probs(logits, eng.sampling, temperature, top_p)
        acc = verify_sampling(sub, tree.tokens, tree.parent, tree.valid, probs, tree.draft_dist,
                              sampled=tree.sampled, assume_q_one=eng.assume_q_one)
    k = acc.num_accepted
    tcache = compact_cache(tcache, acc.path, k, t)

    # Drafter catch-up: rows L+1.. re-read the accepted drafts with target features.
    d = min(eng.tree.max_depth, t - 1)  # the longest path a tree of T nodes can accept
    cu_tokens = _row_gather(tree.tokens, acc.path[:, 1:d + 1])
    cu_feats = _row_gather(hidden, acc.path[:, :d])
    dcache = dataclasses.replace(dcache, lengths=lengths + 1)
    _, dcache = drafter_hidden(dparams, eng.dcfg, params.embed, cu_tokens, cu_feats,
                               lengths[:, None] + 1 + jnp.arange(d), dcache)
    last = _row_gather(acc.path, k[:, None])[:, 0]

    # Commit: accepted drafts then the bonus, cut after the first EOS and at the budget.
    toks, count = committed_tokens(tree.tokens, acc)
    slot = jnp.arange(t)[None, :]
    eos_at = jnp.where(_is_eos(toks, eos_ids) & (slot < count[:, None]), slot, t)
    first_eos = jnp.min(eos_at, axis=1)
    count = jnp.minimum(jnp.minimum(count, first_eos + 1), state.max_new - state.num_new)
    count = jnp.where(live, count, 0)
    rows = jnp.where(slot < count[:, None], state.num_new[:, None] + slot, state.out.shape[1])
    out = state.out.at[jnp.arange(b)[:, None], rows].set(toks, mode="drop")
    num_new = state.num_new + count
    new_len = jnp.where(live, lengths + k + 1, lengths)
    step_rows = jnp.where(live, state.steps, state.out.shape[1])
    hit = jnp.any((shortlists.root_ids == toks[:, :1]) & shortlists.root_valid, axis=-1)
    return SpecState(
        tcache=dataclasses.replace(tcache, lengths=new_len),
        dcache=dataclasses.replace(dcache, lengths=new_len),
        root=jnp.where(live, acc.bonus, state.root),
        root_feat=jnp.where(live[:, None], _row_gather(hidden, last[:, None])[:, 0],
                            state.root_feat),
        out=out, num_new=num_new,
        done=state.done | (first_eos < t) | (num_new >= state.max_new),
        accept_lens=state.accept_lens.at[jnp.arange(b), step_rows].set(count, mode="drop"),
        steps=state.steps + live,
        shortlist_size=state.shortlist_size + jnp.where(live, shortlists.mean_size, 0.0),
        shortlist_hits=state.shortlist_hits + (live & hit), key=key, max_new=state.max_new)


def spec_step(params, dparams, head, state, eos_ids, temperature, top_p,
              eng: Engine) -> SpecState:
    tree, dcache, key, shortlists = draft_phase(params, dparams, head, state, temperature, eng)
    return verify_phase(params, dparams, state, tree, dcache, key, shortlists, eos_ids,
                        temperature, top_p, eng)


@partial(jax.jit, static_argnames=("eng",), donate_argnames=("state",))
def spec_loop(params: Params, dparams: DrafterParams, head: VocabHead, state: SpecState,
              eos_ids: Array, temperature: Array, top_p: Array, *, eng: Engine) -> SpecState:
    """Run :func:`spec_step` until every row is done, in one ``lax.while_loop``."""
    return jax.lax.while_loop(
        lambda s: ~jnp.all(s.done),
        lambda s: spec_step(params, dparams, head, s, eos_ids, temperature, top_p, eng), state)


draft_phase_jit = jax.jit(draft_phase, static_argnames=("eng",))
verify_phase_jit = jax.jit(verify_phase, static_argnames=("eng",), donate_argnames=("state",))
