"""DySpec's dynamic trees (Xiong et al., appendix A): grown by estimated acceptance.

Every node ``u`` has an open *slot*: the next child it would draft. The slot's value is
the probability that verification reaches that child under DySpec's hypothesis (a token's
acceptance rate is its draft probability):

    value(slot of u) = P(path to u accepted) * P(u's earlier children all rejected)
                     = prod(q along the path to u) * (1 - sum of q over u's drafted children)

Drafting the slot's child ``x`` (with draft probability ``q_u(x)``) opens two slots: ``x``'s
first child, value ``value(u) * q_u(x)``, and ``u``'s next child, value
``value(u) * (1 - ...) - value(u) * q_u(x)``. A slot's value is known *before* its token
is drawn, and choosing slots by it never looks at the token it is about to keep. So
sampled children remain draws without replacement from q under a stopping rule, and
multi-draft rejection sampling verifies them exactly.

* :func:`build_dyspec` (algorithm 1, ``kind="dyspec"``): ``total_tokens`` times, draft
  the child of the best open slot (a masked argmax stands in for the heap); the drafter
  runs once per drafted node, so the tree is the greedy optimum of the estimated accepted
  length (appendix D), at one drafter call per node.
* :func:`build_dyspec_threshold` (algorithm 2, ``kind="dyspec-threshold"``): layer by
  layer, draft every child whose slot value is at least ``threshold`` (at most
  ``total_tokens`` in all, the highest values first): at most one drafter call per layer,
  over at most ``frontier`` nodes, and none for a layer with nothing worth expanding.

In sampled mode children come in Gumbel-top-k order (sampling without replacement) and a
slot is keyed by the paper's value above, the chance that verification *reaches* it
(``value="reach"``). In deterministic mode (temperature 0) children come in top-k order of
q, so the token a slot would draft and its q are known before the slot is chosen, and
verification is greedy: any tree is lossless. There a slot is keyed by the chance that the
node it would draft is *accepted*, ``value(u) * q_u(x)`` = the product of q along the new
node's path (``value="accept"``). The sum of those over the tree is the estimated accepted
length itself, which the greedy heap then maximises exactly (a child's path product never
exceeds its parent's). Keying greedy trees by "reach" overrates later siblings: after a
first child with q = 0.3 the second slot is worth 0.7 of its parent although its own
child holds perhaps 0.1, and the tree grows too wide (docs/benchmarks.md, issue 13).

``TreeSpec(topk_children=True)`` builds the deterministic tree even when sampling, and
verification then uses the point-mass rule (as for EAGLE-2): exact for any tree chosen
before the target's coins. Against the sampled tree it trades the multi-draft rule's use
of q for drafts that are the drafter's best guesses; with a weak drafter and a peaked
target those are accepted more often (docs/benchmarks.md).

``TreeSpec(greedy_children=g)`` keeps the sampled tree but drafts each node's last g
children as q's top g tokens and samples the others without replacement from q without
them (Hu et al., 2025, "Towards Optimal Multi-draft Speculative Decoding"). Verification
tries the sampled ones first (against q') and then q's top ones by the point-mass rule
(``DraftTree.fixed``): a rejected sampled child leaves all of the target's mass on them,
so the root accepts p(top) + sum_{y != top} min(p(y), q'(y)) with one such child: offline,
more often than three children all sampled from q on the SmolLM2 drafter, a gain the loop's
MAL has not resolved (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from specjax.tree.base import (
    Carry,
    DraftTree,
    ExpandFn,
    candidate_vocab,
    dense_dist,
    draft_children,
    draft_mode,
    finish_tree,
)
from specjax.tree.order import bfs_order, permute_nodes
from specjax.tree.spec import TreeSpec, register


def _log_rest(logq: Array) -> Array:
    """log(1 - sum of q before each child) [..., m], for children in drafted order."""
    q = jnp.exp(logq)
    before = jnp.cumsum(q, axis=-1) - q
    return jnp.log(jnp.maximum(1.0 - before, 0.0))


def _slot_values(logv: Array, kids_logq: Array, value: str,
                 fixed_slot: np.ndarray | None = None) -> Array:
    """log value of each child slot [..., m] of nodes with log path value ``logv`` [...].

    ``"accept"``: the path product of the child the slot would draft; ``"reach"``: the
    chance that verification gets to the slot (every earlier sibling rejected). Slots in
    ``fixed_slot`` [m] (q's top children of a greedy multi-draft) are keyed by "accept"
    either way: their token is fixed before any draw, so keying by it biases no draw, and
    their chance of acceptance is q(top) whatever the sampled siblings before them took
    of q' (a sampled sibling's rejection leaves all of the target's mass on them).
    """
    rest = kids_logq if value == "accept" else _log_rest(kids_logq)
    if fixed_slot is not None:
        rest = jnp.where(jnp.asarray(fixed_slot), kids_logq, rest)
    return logv[..., None] + rest


def _value_kind(value: str | None, sampled: bool) -> str:
    """The slot key: "reach" when sampling (it must not look at the drawn token), else
    "accept" unless asked otherwise."""
    if value is None:
        return "reach" if sampled else "accept"
    if value not in ("accept", "reach"):
        raise ValueError(f"value must be 'accept' or 'reach', got {value!r}")
    if sampled and value == "accept":
        raise ValueError("sampled trees must key slots by 'reach': choosing a slot by the "
                         "token it would draw biases the draws verification assumes")
    return value


def _child_table(ids: Array, logits: Array, m: int, mode, key: Array | None, greedy: int):
    """The first ``m`` children of each expanded node in drafted order, and q (sampled):
    the law of the sampled ones; with ``greedy`` the last that many are q's top ones."""
    ch = draft_children(ids, logits, m, mode, key, greedy if mode.sampled else 0)
    return ch.ids, ch.logq, ch.cand_q


def _fixed_slots(m: int, mode, greedy: int) -> np.ndarray | None:
    """[m] bool, which of a node's ``m`` drafted children are deterministic (the last
    ``greedy`` when sampling); None when none are."""
    return np.arange(m) >= m - greedy if mode.sampled and greedy else None


def _expand_root(expand: ExpandFn, carry: Carry, root: Array, total_tokens: int, mode,
                 vocab_size: int | None, greedy: int):
    """Expand the root (workspace slot 0 of ``total_tokens + 1``).

    Returns (carry, candidate ids [B, 1, C], m = children kept per node, V of draft_dist,
    the root's children: ids [B, 1, m], log q [B, 1, m], candidate q [B, 1, C] or None).
    """
    b = root.shape[0]
    zeros = jnp.zeros((b, 1), jnp.int32)
    rows = jnp.zeros((b, 1, total_tokens + 1), bool).at[:, :, 0].set(True)
    carry, ids, logits = expand(carry, root[:, None], zeros, zeros, rows, 0)
    m = min(total_tokens, ids.shape[-1])
    if mode.sampled and greedy >= m:
        raise ValueError(f"greedy_children ({greedy}) must be fewer than the {m} children a "
                         f"node drafts, so that at least one is sampled")
    key = jax.random.fold_in(mode.key, 0) if mode.sampled else None
    return (carry, ids, m, candidate_vocab(vocab_size, ids.shape[-1]),
            *_child_table(ids, logits, m, mode, key, greedy))


def build_dyspec(expand: ExpandFn, carry: Carry, root: Array, total_tokens: int, *,
                 key: Array | None = None, temperature: float | Array = 0.0,
                 vocab_size: int | None = None, value: str | None = None,
                 greedy: int = 0) -> tuple[DraftTree, Carry]:
    """DySpec's greedy tree (algorithm 1) with ``total_tokens`` drafted nodes.

    Node i (1..T-1) is drafted at iteration i from the open slot of the highest value; node
    i is then expanded by the drafter (K = 1, workspace slot i) so that its own slot is
    open from the next iteration. The last node is not expanded: no child of it could be
    kept. A row whose open slots all have value 0 (every candidate drafted, or none
    valid) pads the rest of its tree.

    The draft step passed to ``expand`` is 0 for every call: a node's depth is data
    dependent here, so a position-aware vocabulary head gives every expansion its
    step-0 budget.

    ``value`` keys the slots (see the module docstring): None picks "accept" for
    deterministic trees and "reach" for sampled ones.

    Returns the tree in breadth-first layout (see :func:`specjax.tree.order.bfs_order`).
    """
    if total_tokens < 1:
        raise ValueError(f"total_tokens must be >= 1, got {total_tokens}")
    mode = draft_mode(key, temperature)
    value = _value_kind(value, mode.sampled)
    root = root.astype(jnp.int32)
    b, t = root.shape[0], total_tokens + 1
    bi = jnp.arange(b)
    eye = jnp.eye(t, dtype=bool)
    carry, ids, m, vocab, k_ids, k_logq, cand_q = _expand_root(expand, carry, root,
                                                              total_tokens, mode, vocab_size,
                                                              greedy)
    fixed_slot = _fixed_slots(m, mode, greedy)
    fixed = None if fixed_slot is None else jnp.zeros((b, t), bool)
    kids = jnp.zeros((b, t, m), jnp.int32).at[:, 0].set(k_ids[:, 0])
    kids_logq = jnp.full((b, t, m), -jnp.inf, jnp.float32).at[:, 0].set(k_logq[:, 0])
    dist = (jnp.zeros((b, t, vocab), jnp.float32).at[:, 0].set(
        dense_dist(ids, cand_q, vocab)[:, 0]) if mode.sampled else None)

    tokens = jnp.zeros((b, t), jnp.int32).at[:, 0].set(root)
    parent = jnp.full((b, t), -1, jnp.int32)
    depth = jnp.zeros((b, t), jnp.int32)
    valid = jnp.zeros((b, t), bool).at[:, 0].set(True)
    anc = jnp.broadcast_to(eye, (b, t, t))
    logv = jnp.full((b, t), -jnp.inf, jnp.float32).at[:, 0].set(0.0)  # log path prob
    logp = jnp.zeros((b, t), jnp.float32)
    used = jnp.zeros((b, t), jnp.int32)  # children drafted per node

    for i in range(1, t):  # unrolled: one drafter call per node
        nxt = jnp.minimum(used, m - 1)[..., None]
        lq_next = jnp.take_along_axis(kids_logq, nxt, axis=2)[..., 0]
        slot_v = jnp.take_along_axis(_slot_values(logv, kids_logq, value, fixed_slot), nxt,
                                     axis=2)[..., 0]
        open_ = valid & (used < m) & jnp.isfinite(lq_next)
        slot = jnp.where(open_, slot_v, -jnp.inf)
        u = jnp.argmax(slot, axis=1)  # the lowest index on ties
        has = jnp.isfinite(jnp.max(slot, axis=1))
        k = used[bi, u]
        tok, lq = kids[bi, u, k], kids_logq[bi, u, k]
        tokens = tokens.at[:, i].set(jnp.where(has, tok, 0))
        parent = parent.at[:, i].set(jnp.where(has, u, 0).astype(jnp.int32))
        depth = depth.at[:, i].set(depth[bi, u] + 1)
        valid = valid.at[:, i].set(has)
        anc = anc.at[:, i].set(anc[bi, u] | eye[i])
        logv = logv.at[:, i].set(jnp.where(has, logv[bi, u] + lq, -jnp.inf))
        logp = logp.at[:, i].set(lq)
        if fixed is not None:
            fixed = fixed.at[:, i].set(jnp.asarray(fixed_slot)[k])
        used = used.at[bi, u].add(has.astype(jnp.int32))
        if i == t - 1:
            break
        carry, ids, logits = expand(carry, tokens[:, i:i + 1], depth[:, i:i + 1],
                                    jnp.full((b, 1), i, jnp.int32), anc[:, i:i + 1], 0)
        k_ids, k_logq, cand_q = _child_table(
            ids, logits, m, mode, jax.random.fold_in(mode.key, i) if mode.sampled else None,
            greedy)
        kids = kids.at[:, i].set(k_ids[:, 0])
        kids_logq = kids_logq.at[:, i].set(jnp.where(has[:, None], k_logq[:, 0], -jnp.inf))
        if mode.sampled:
            dist = dist.at[:, i].set(dense_dist(ids, cand_q, vocab)[:, 0] * has[:, None])

    tree = finish_tree(tokens, parent, depth, valid, anc, logp, logv, dist, mode.sampled, fixed)
    return permute_nodes(tree, bfs_order(tree)), carry


def build_dyspec_threshold(expand: ExpandFn, carry: Carry, root: Array, total_tokens: int,
                           depth: int, threshold: float, *, frontier: int | None = None,
                           key: Array | None = None, temperature: float | Array = 0.0,
                           vocab_size: int | None = None, value: str | None = None,
                           greedy: int = 0) -> tuple[DraftTree, Carry]:
    """DySpec's layer-by-layer tree (algorithm 2): every slot worth at least ``threshold``.

    Layer d (1..``depth``) drafts, for every expanded node of layer d-1, the children whose
    slot value is >= ``threshold`` (a prefix of its drafted order, since values fall along
    it), keeping at most the remaining budget of ``total_tokens`` nodes, highest values
    first (the lower index on ties). Of the new layer, the ``frontier`` nodes of highest
    path value (default and at most ``total_tokens``) are expanded, in one drafter call
    with K = ``frontier`` rows (padding repeats a real node); the others stay leaves, like
    EAGLE-2's nodes outside its beam. A node whose path value is below ``threshold`` is
    never expanded: no slot under it can reach the threshold.

    The drafter call of a layer runs under ``lax.cond``: when no row has a node left to
    expand (or budget left), it is skipped, so a step costs what its realised tree needs
    (at batch 1; a batch skips only when every row is done). ``expand`` must then be free
    of trace-time side effects after the root's call (:class:`TreeBuilder`).

    Nodes are numbered as they are drafted, which is breadth first. With ``threshold``
    equal to the value of the greedy tree's last node and no frontier cap, both builders
    keep the same nodes (the paper's remark). ``value`` keys the slots as in
    :func:`build_dyspec`.
    """
    if total_tokens < 1 or depth < 1:
        raise ValueError(f"total_tokens and depth must be >= 1, got {total_tokens}, {depth}")
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"threshold must lie in (0, 1), got {threshold}")
    if frontier is not None and frontier < 1:
        raise ValueError(f"frontier must be >= 1 (or None: total_tokens), got {frontier}")
    mode = draft_mode(key, temperature)
    value_kind = _value_kind(value, mode.sampled)
    root = root.astype(jnp.int32)
    b, t = root.shape[0], total_tokens + 1
    kf = min(frontier or total_tokens, total_tokens)
    bi = jnp.arange(b)[:, None]
    eye = jnp.eye(t, dtype=bool)
    log_thr = math.log(threshold)
    carry, ids, m, vocab, k_ids, k_logq, cand_q = _expand_root(expand, carry, root,
                                                              total_tokens, mode, vocab_size,
                                                              greedy)
    fixed_slot = _fixed_slots(m, mode, greedy)
    fixed = None if fixed_slot is None else jnp.zeros((b, t), bool)
    # The frontier: kf slots; only slot 0 (the root) is real at first.
    f_node = jnp.zeros((b, kf), jnp.int32)
    f_valid = jnp.zeros((b, kf), bool).at[:, 0].set(True)
    f_logv = jnp.zeros((b, kf), jnp.float32)
    pad = lambda x, fill: jnp.concatenate(  # noqa: E731
        [x, jnp.full((b, kf - 1) + x.shape[2:], fill, x.dtype)], axis=1)
    f_kids, f_kids_logq = pad(k_ids, 0), pad(k_logq, -jnp.inf)
    f_dist = pad(dense_dist(ids, cand_q, vocab), 0.0) if mode.sampled else None

    tokens = jnp.zeros((b, t), jnp.int32).at[:, 0].set(root)
    parent = jnp.full((b, t), -1, jnp.int32)
    node_depth = jnp.zeros((b, t), jnp.int32)
    valid = jnp.zeros((b, t), bool).at[:, 0].set(True)
    anc = jnp.broadcast_to(eye, (b, t, t))
    logv = jnp.zeros((b, t), jnp.float32)
    logp = jnp.zeros((b, t), jnp.float32)
    dist = (jnp.zeros((b, t, vocab), jnp.float32).at[:, 0].set(f_dist[:, 0])
            if mode.sampled else None)
    count = jnp.ones((b,), jnp.int32)  # nodes so far

    for d in range(1, depth + 1):  # unrolled: at most one drafter call per layer
        slot_v = _slot_values(f_logv, f_kids_logq, value_kind, fixed_slot)  # [B, kf, m]
        ok = f_valid[..., None] & jnp.isfinite(f_kids_logq) & (slot_v >= log_thr)
        flat_val = jnp.where(ok, slot_v, -jnp.inf).reshape(b, kf * m)
        # Rank among this layer's candidates by value (lower flat index first on ties);
        # keep those within the remaining budget.
        keep = jnp.isfinite(flat_val) & (_ranks(flat_val) < (t - count)[:, None])
        new_idx = count[:, None] + jnp.cumsum(keep, axis=1) - 1  # in flat (parent, k) order
        dest = jnp.where(keep, new_idx, t)  # out of range: dropped
        par = jnp.repeat(f_node, m, axis=1)
        lq = f_kids_logq.reshape(b, kf * m)
        new_logv = jnp.repeat(f_logv, m, axis=1) + lq
        tokens = tokens.at[bi, dest].set(f_kids.reshape(b, kf * m), mode="drop")
        parent = parent.at[bi, dest].set(par, mode="drop")
        node_depth = node_depth.at[bi, dest].set(d, mode="drop")
        valid = valid.at[bi, dest].set(True, mode="drop")
        logv = logv.at[bi, dest].set(new_logv, mode="drop")
        logp = logp.at[bi, dest].set(lq, mode="drop")
        if fixed is not None:  # slot k of every frontier node, in flat (parent, k) order
            fixed = fixed.at[bi, dest].set(jnp.asarray(np.tile(fixed_slot, kf))[None],
                                           mode="drop")
        anc = anc.at[bi, dest].set(anc[bi, par] | eye[jnp.clip(dest, 0, t - 1)], mode="drop")
        n_new = jnp.sum(keep, axis=1)
        count = count + n_new
        if d == depth:
            break
        # The next frontier: of this layer's new nodes, those that can still have a kept
        # child (path value >= threshold, budget left), the kf of highest path value,
        # compacted into kf slots in node order; padding repeats the first of them (or the
        # root, in a row with none).
        expandable = keep & (new_logv >= log_thr) & (count < t)[:, None]
        front = expandable & (_ranks(jnp.where(expandable, new_logv, -jnp.inf)) < kf)
        n_front = jnp.sum(front, axis=1)
        slot_of = jnp.where(front, jnp.cumsum(front, axis=1) - 1, kf)
        first = jnp.where(n_front > 0, jnp.min(jnp.where(front, new_idx, t), axis=1), 0)
        f_node = jnp.broadcast_to(first[:, None], (b, kf)).at[bi, slot_of].set(new_idx,
                                                                               mode="drop")
        f_valid = jnp.arange(kf)[None, :] < n_front[:, None]
        f_logv = jnp.where(f_valid, logv[bi, f_node], -jnp.inf)

        def draft_layer(c, tok, dep, node, rows, d=d):
            c, ids, logits = expand(c, tok, dep, node, rows, d)
            kids, kids_logq, cand_q = _child_table(
                ids, logits, m, mode, jax.random.fold_in(mode.key, d) if mode.sampled else None,
                greedy)
            return c, kids, kids_logq, (dense_dist(ids, cand_q, vocab) if mode.sampled
                                        else None)

        def skip_layer(c, *_):  # draft_layer's shapes, known without tracing expand again
            return (c, jnp.zeros((b, kf, m), jnp.int32),
                    jnp.full((b, kf, m), -jnp.inf, jnp.float32),
                    jnp.zeros((b, kf, vocab), jnp.float32) if mode.sampled else None)

        carry, f_kids, f_kids_logq, q = jax.lax.cond(
            jnp.any(f_valid), draft_layer, skip_layer, carry, tokens[bi, f_node],
            node_depth[bi, f_node], f_node, anc[bi, f_node])
        f_kids_logq = jnp.where(f_valid[..., None], f_kids_logq, -jnp.inf)
        if mode.sampled:
            q = q * f_valid[..., None]
            dist = dist.at[bi, jnp.where(f_valid, f_node, t)].set(q, mode="drop")

    tree = finish_tree(tokens, parent, node_depth, valid, anc, logp, logv, dist, mode.sampled,
                       fixed)
    return tree, carry


def _ranks(values: Array) -> Array:
    """[B, N] int32 each entry's rank by descending value along the last axis (the lower
    index first on ties; -inf entries rank last)."""
    return jnp.argsort(jnp.argsort(-values, axis=1, stable=True), axis=1).astype(jnp.int32)


def _drafting(spec: TreeSpec, key: Array | None,
              temperature: float | Array) -> tuple[Array | None, float | Array]:
    """The (key, temperature) children are drafted with: deterministic top-k (keyed by
    "accept", verified by the point-mass rule) for ``spec.topk_children``, whatever the
    sampling temperature; the target still samples at its own temperature."""
    return (None, 0.0) if spec.topk_children else (key, temperature)


@dataclasses.dataclass(frozen=True)
class DySpecBuilder:
    """``kind="dyspec"``: the greedy tree of ``spec.total_tokens`` drafted nodes."""

    samples_children: ClassVar[bool] = True
    skips_expansions: ClassVar[bool] = False

    def prepare(self, spec: TreeSpec) -> dict[str, Any]:
        if spec.depth != TreeSpec.depth:
            # Algorithm 1 grows whatever shape its budget buys (a chain, at worst); a depth
            # given to it would be ignored, so it is refused instead.
            raise ValueError(f"dyspec trees have no depth limit (total_tokens shapes them); "
                             f"got depth={spec.depth}: drop it, or use kind="
                             f"'dyspec-threshold', whose depth caps its layers")
        return {}

    def num_nodes(self, spec: TreeSpec) -> int:
        return spec.total_tokens + 1

    def max_depth(self, spec: TreeSpec) -> int:
        return spec.total_tokens  # a chain, at worst

    def workspace(self, spec: TreeSpec) -> int:
        return spec.total_tokens + 1

    def build(self, spec: TreeSpec, expand: ExpandFn, carry: Carry, root: Array,
              key: Array | None, temperature: float | Array,
              vocab_size: int) -> tuple[DraftTree, Carry]:
        key, temperature = _drafting(spec, key, temperature)
        return build_dyspec(expand, carry, root, spec.total_tokens, key=key,
                            temperature=temperature, vocab_size=vocab_size,
                            greedy=spec.greedy_children)


@dataclasses.dataclass(frozen=True)
class DySpecThresholdBuilder:
    """``kind="dyspec-threshold"``: layers of slots worth >= ``spec.threshold``, at most
    ``spec.depth`` layers and ``spec.total_tokens`` nodes; ``spec.frontier`` nodes (0: all)
    expanded per layer."""

    samples_children: ClassVar[bool] = True
    skips_expansions: ClassVar[bool] = True

    def prepare(self, spec: TreeSpec) -> dict[str, Any]:
        if not 0.0 < spec.threshold < 1.0:
            raise ValueError(f"a dyspec-threshold tree needs 0 < threshold < 1, got "
                             f"{spec.threshold!r}")
        return {}

    def num_nodes(self, spec: TreeSpec) -> int:
        return spec.total_tokens + 1

    def max_depth(self, spec: TreeSpec) -> int:
        return min(spec.depth, spec.total_tokens)

    def workspace(self, spec: TreeSpec) -> int:
        return spec.total_tokens + 1

    def build(self, spec: TreeSpec, expand: ExpandFn, carry: Carry, root: Array,
              key: Array | None, temperature: float | Array,
              vocab_size: int) -> tuple[DraftTree, Carry]:
        key, temperature = _drafting(spec, key, temperature)
        return build_dyspec_threshold(expand, carry, root, spec.total_tokens, spec.depth,
                                      spec.threshold, frontier=spec.frontier or None, key=key,
                                      temperature=temperature, vocab_size=vocab_size,
                                      greedy=spec.greedy_children)


register("dyspec", DySpecBuilder())
register("dyspec-threshold", DySpecThresholdBuilder())
