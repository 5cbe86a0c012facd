"""Lookup drafts: a chain copied from the committed text, grafted onto the drafter's tree.

Small targets copy their context. On the 24 Spec-Bench prompts, SmolLM2-135M's greedy
answer continues a span that occurred earlier (prompt or answer) so often that copying the
token that followed the longest matching suffix predicts the next token 46% of the time,
against 34% for the trained one-layer drafter, and one of the two is right 65% of the
time (docs/benchmarks.md). A one-layer drafter cannot copy: finding where the current
token occurred before and reading the token after it takes an induction circuit, two
attention layers in a row. So the draft step adds a chain found by lookup, as prompt
lookup decoding (Saxena, 2023) and SAM-Decoding (Hu et al., 2024) do beside a drafter:

* :func:`lookup_continuation` finds the latest earlier occurrence of the longest suffix
  (up to ``ngram`` tokens) of the committed text and proposes the ``length`` tokens that
  followed it. When the occurrence ends right before the suffix (a repetition loop), the
  continuation repeats the period instead of running out of text.
* :func:`graft_chain` merges that chain into the drafter's tree: it walks down existing
  nodes while their tokens agree, and hangs the rest below the last one as new nodes, so
  no node gains a child that repeats a sibling's token.
* :func:`graft_lookup` is the draft step's use of the two: search each row's committed
  text, graft where the match is long enough.

Grafted nodes are deterministic drafts, marked in ``DraftTree.fixed`` (they come after
every drafted node, so each is tried after all its drafted siblings). Greedy verification
accepts them by the target's argmax; sampling verification by the point-mass rule, even in
a tree whose drafted children were sampled from q and are verified against q: once those
siblings are rejected, the residual is the law the next token must have, and a point-mass
step on it is exact for any fixed token (:func:`specjax.verify.verify_sampling`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np
from jax import Array

from specjax.loop import PAD  # the Output's empty slot; never a token id
from specjax.tree.base import DraftTree, finish_tree

if TYPE_CHECKING:
    from specjax.tree.spec import TreeSpec
    from specjax.vocab.head import Candidates


def committed_history(prompt: Array, out_tokens: Array, num_new: Array) -> tuple[Array, Array]:
    """Each row's committed text, prompt then output, left-aligned.

    Args:
      prompt: [B, P] int32 right-padded with PAD (-1) past each row's prompt.
      out_tokens: [B, N] int32 the output (PAD past ``num_new``); its last committed token
        is the step's root.
      num_new: [B] int32 committed output tokens.
    Returns:
      (history [B, P + N] int32, PAD past ``lengths``; lengths [B] int32).
    """
    p = prompt.shape[1]
    plen = jnp.sum(prompt != PAD, axis=1).astype(jnp.int32)
    i = jnp.arange(p + out_tokens.shape[1])[None, :]
    src = jnp.where(i < plen[:, None], i, p + i - plen[:, None])
    both = jnp.concatenate([prompt, out_tokens], axis=1)
    hist = jnp.take_along_axis(both, jnp.clip(src, 0, both.shape[1] - 1), axis=1)
    lengths = plen + num_new
    return jnp.where(i < lengths[:, None], hist, PAD), lengths


def lookup_continuation(history: Array, lengths: Array, length: int,
                        ngram: int) -> tuple[Array, Array]:
    """The ``length`` tokens that followed the latest earlier occurrence of the longest
    suffix of ``history`` (at most ``ngram`` tokens, at least one).

    Args:
      history: [B, N] int32, valid in ``[0, lengths[b])``.
      lengths: [B] int32.
      length: static, tokens to propose.
      ngram: static, the longest suffix tried.
    Returns:
      (tokens [B, length] int32, match [B] int32 the suffix length matched, 0..ngram). Rows
      where the last token never occurred before have ``match == 0`` (their tokens are
      meaningless).
    """
    b, n = history.shape
    j = jnp.arange(n)[None, :]  # where an earlier occurrence of the suffix ends
    run = jnp.ones((b, n), bool)
    match = jnp.zeros((b, n), jnp.int32)
    for g in range(ngram):
        at = lengths - 1 - g
        s = jnp.take_along_axis(history, jnp.clip(at, 0, n - 1)[:, None], axis=1)  # [B, 1]
        back = jnp.pad(history, ((0, 0), (g, 0)), constant_values=PAD)[:, :n]  # history[j - g]
        run = run & (back == s) & (at >= 0)[:, None]
        match = match + run
    # Only occurrences that end before the last token count; their continuation starts at
    # j + 1 <= lengths - 1.
    match = jnp.where(j < (lengths - 1)[:, None], match, 0)
    best = jnp.argmax(match * n + j, axis=1).astype(jnp.int32)  # longest, then latest
    # history[best + 1 ..] continues the suffix; past the last token it continues with the
    # proposal itself, whose period is lengths - 1 - best.
    period = jnp.maximum(lengths - 1 - best, 1)
    idx = best[:, None] + 1 + jnp.arange(length)[None, :] % period[:, None]
    return (jnp.take_along_axis(history, jnp.clip(idx, 0, n - 1), axis=1),
            jnp.max(match, axis=1))


def graft_chain(tree: DraftTree, tokens: Array, found: Array) -> DraftTree:
    """Merge a chain below each root into ``tree``; the result has ``T + K`` nodes.

    The chain first follows existing nodes whose tokens agree (root's child, its child,
    ...); its remaining tokens become nodes ``T, T+1, ..`` below the last node followed.
    Nodes of the chain not needed (matched inside the tree) and rows with ``found ==
    False`` are padding. Grafted nodes have ``draft_logp`` 0 (a point mass) and inherit
    their parent's score; a grafted node has no draft distribution (zeros).

    Args:
      tree: the drafter's tree, T nodes.
      tokens: [B, K] int32 the chain, first token the root's child.
      found: [B] bool rows that have a chain.
    """
    b, t = tree.tokens.shape
    k = tokens.shape[1]
    cur = jnp.zeros((b,), jnp.int32)
    matched = jnp.zeros((b,), jnp.int32)
    following = found
    for i in range(k):
        hit = tree.valid & (tree.parent == cur[:, None]) & (tree.tokens == tokens[:, i:i + 1])
        following = following & jnp.any(hit, axis=1)
        cur = jnp.where(following, jnp.argmax(hit, axis=1).astype(jnp.int32), cur)
        matched = matched + following
    j = jnp.arange(k)[None, :]
    new_valid = found[:, None] & (matched[:, None] + j < k)
    new_tokens = jnp.take_along_axis(tokens, jnp.clip(matched[:, None] + j, 0, k - 1), axis=1)
    new_parent = jnp.where(j == 0, cur[:, None], t + j - 1)
    at_cur = lambda x: jnp.take_along_axis(x, cur[:, None], axis=1)  # noqa: E731
    new_depth = at_cur(tree.depth) + 1 + j
    # Ancestors of grafted node j: those of ``cur``, then grafted nodes 0..j.
    cur_row = jnp.take_along_axis(tree.ancestors, cur[:, None, None], axis=1)  # [B, 1, T]
    lower = jnp.concatenate([jnp.broadcast_to(cur_row, (b, k, t)),
                             jnp.broadcast_to(jnp.asarray(np.tri(k, dtype=bool)), (b, k, k))],
                            axis=2)
    upper = jnp.pad(tree.ancestors, ((0, 0), (0, 0), (0, k)))
    cat = lambda x, y: jnp.concatenate([x, y], axis=1)  # noqa: E731
    dist = tree.draft_dist
    if dist is not None:
        dist = jnp.pad(dist, ((0, 0), (0, k), (0, 0)))
    fixed = jnp.zeros((b, t), bool) if tree.fixed is None else tree.fixed
    return finish_tree(
        cat(tree.tokens, new_tokens), cat(tree.parent, new_parent), cat(tree.depth, new_depth),
        cat(tree.valid, new_valid), cat(upper, lower),
        cat(tree.draft_logp, jnp.zeros((b, k), tree.draft_logp.dtype)),
        cat(tree.score, jnp.broadcast_to(at_cur(tree.score), (b, k))), dist, tree.sampled,
        cat(fixed, jnp.ones((b, k), bool)))


def graft_lookup(tree: DraftTree, spec: TreeSpec, prompt: Array, out_tokens: Array,
                 num_new: Array, live: Array | None = None) -> tuple[DraftTree, Array]:
    """The draft step's lookup chain: ``spec.lookup`` tokens found in each row's committed
    text (prompt [B, P], PAD past its length, then ``out_tokens`` [B, N] of which
    ``num_new`` [B] are committed), grafted into ``tree`` ([B, T] nodes) where the suffix
    matched at least ``spec.lookup_min`` tokens and the row is ``live`` ([B] bool, default
    all).

    Returns (the grafted tree, [B, T + spec.lookup] nodes; [B] bool, the rows that took a
    chain). The other rows keep the tree as it was, padding nodes after it.
    """
    hist, hist_len = committed_history(prompt, out_tokens, num_new)
    chain, match = lookup_continuation(hist, hist_len, spec.lookup, spec.lookup_ngram)
    chained = match >= spec.lookup_min
    if live is not None:
        chained = chained & live
    return graft_chain(tree, chain, chained), chained


def copy_bias(spec: TreeSpec, prompt: Array, out_tokens: Array,
              num_new: Array) -> tuple[Array, Array]:
    """The root's copy gate (``spec.copy_bias``): the lookup token and its logit bonus.

    The token is the one that followed the latest occurrence of the longest suffix of the
    committed text, up to ``len(spec.copy_bias)`` tokens; the bonus is ``copy_bias[m - 1]``
    for a suffix of m tokens, 0 where the last token never occurred before.

    The committed text is read as :func:`graft_lookup` reads it (prompt [B, P], PAD past
    its length, then ``num_new`` [B] tokens of ``out_tokens`` [B, N]).

    Returns:
      (token [B] int32, bonus [B] float32).
    """
    table = jnp.asarray((0.0, *spec.copy_bias), jnp.float32)
    hist, hist_len = committed_history(prompt, out_tokens, num_new)
    tokens, match = lookup_continuation(hist, hist_len, 1, len(spec.copy_bias))
    return tokens[:, 0], table[match]


def gate_root(cand: Candidates, h: Array, w: Array, token: Array, bonus: Array) -> Candidates:
    """The root's candidates with the copy gate applied: ``bonus`` [B] added to the logit of
    each row's lookup ``token`` [B].

    A shortlist head may lack the token (SmolLM2 copies names and foreign words that
    ``fr:8192`` leaves out); where a row fires (bonus > 0) and its K copies of the root
    ([B, K, C] candidates) do not offer the token, it takes the slot of their lowest logit
    (a padding slot first, whose logit is ``-inf``) with the drafter's own logit for it,
    ``h [B, K, d] . w[token]`` (w: the [V, d] LM head, as every head scores its ids). So the
    candidates stay distinct ids, and when sampling q is the softmax of what is returned.
    """
    hit = cand.valid & (cand.ids == token[:, None, None])
    put = ~jnp.any(hit, axis=-1) & (bonus > 0)[:, None]  # [B, K]
    slot = jnp.argmin(cand.logits, axis=-1)
    into = put[..., None] & (jnp.arange(cand.ids.shape[-1]) == slot[..., None])
    own = jnp.einsum("bkd,bd->bk", h.astype(jnp.float32), w[token].astype(jnp.float32))
    ids = jnp.where(into, token[:, None, None], cand.ids)
    logits = jnp.where(into, own[..., None].astype(cand.logits.dtype), cand.logits)
    logits = logits + jnp.where(hit | into, bonus[:, None, None], 0.0).astype(logits.dtype)
    return dataclasses.replace(cand, ids=ids, valid=cand.valid | into, logits=logits)
