"""``specjax bench breakdown``: where the time of one draft step goes (cf. FR-Spec, fig. 6).

One expansion of ``K`` frontier nodes by the EAGLE drafter is, in order:

(a) the embedding gather of the K tokens and ``fc`` over [embedding; feature] ([K, 2d] x
    [2d, d]);
(b) the drafter's decoder layers: attention over a realistic cache (every allocated row,
    masked, as in decoding) plus the MLP;
(c) the vocabulary head (``--vocab``: the full vocabulary, ``[K, d] x [V, d]^T``, or a
    shortlist head's candidates) plus the children's log-softmax and top-k, which the tree
    builder runs on the head's logits.

A draft step's first expansion is the root's, and it is the head alone: the previous
step's catch-up already ran the drafter's layers on the root (``SpecState.root_h``), so
the root's (a) and (b) are paid in the verify phase and reported apart. The later
expansions pay all three. The plan, one entry per expansion: a chain of depth D expands
D times one node; EAGLE-2 the root, then ``depth - 1`` beams of ``top_k``; a static tree
one call per level, each over the widest level's nodes with children (the builder pads
the others). DySpec trees expand a data-dependent number of nodes and are refused here
(``bench spec`` times their draft phase whole). On top of the expansions:

(d) the tree's own work (beam / pool selection, layout, ancestor masks, and for a tree
    with a lookup chain, the search of the context and the graft), timed by running the
    builder with a trivial ``expand`` that returns precomputed candidates, so (c)'s
    vocabulary-wide work is not counted twice;

and an "other" remainder: the measured jitted draft phase minus the sum above (the per-node
feature gather and scatter of the real ``expand``, and what separate jits cannot fuse; it
can come out slightly negative, since fusing the pieces also saves work).

Every piece is a separate jitted micro-benchmark at B=1 on the real target and drafter,
best of ``runs`` calls after a compile call. The target's verify forward over the tree's T
nodes (and a vanilla T=1 forward) are timed too, for scale. Output: JSON + stacked bar PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from tqdm import tqdm

import specjax
from specjax.bench.common import as_command, machine_info, pyplot, save_figure, write_json
from specjax.bench.phases import draft_latency, random_features, resolve_drafter
from specjax.bench.timing import time_calls, verify_latency
from specjax.bench.trees import (
    DRAFTER_DEFAULT,
    add_tree_args,
    resolve_tree,
    tree_dict,
    tree_from_args,
    tree_label,
)
from specjax.defaults import resolve_model
from specjax.drafter import (
    DrafterConfig,
    DrafterParams,
    fc_input,
    in_target_layout,
    init_drafter_cache,
)
from specjax.loaded import Drafter, Target
from specjax.loop import PAD, bucket
from specjax.model import (
    FusedLayerParams,
    LayerParams,
    cache_mask,
    decoder_layer,
    rope_inv_freq,
)
from specjax.speculative import TreeSpec, cache_capacity
from specjax.tree.lookup import graft_lookup
from specjax.vocab import VocabHead, resolve_head

PARTS = ("embed_fc", "layer", "head_topk")
PART_LABELS = {"embed_fc": "(a) embedding gather + fc", "layer": "(b) drafter layers",
               "head_topk": "(c) vocabulary head + top-k", "tree_ops": "(d) tree ops",
               "other": "other (measured - sum)"}
COLORS = {"embed_fc": "tab:green", "layer": "tab:blue", "head_topk": "tab:red",
          "tree_ops": "tab:orange", "other": "tab:gray", "verify": "tab:purple"}


@jax.jit
def _embed_fc(embed: Array, dp: DrafterParams, tokens: Array, feats: Array) -> Array:
    """(a): [B, K] tokens and [B, K, d] features -> fc input projection [B, K, d]."""
    return fc_input(dp, embed, tokens, feats)


@partial(jax.jit, static_argnames=("dcfg",), donate_argnames=("k_buf", "v_buf"))
def _drafter_layer(layer: LayerParams | FusedLayerParams, dcfg: DrafterConfig, x: Array,
                   positions: Array, k_buf: Array, v_buf: Array, lengths: Array,
                   block_mask: Array, write_rows: Array) -> tuple[Array, Array, Array]:
    """(b): one drafter layer on x [B, K, d] over a [B, S, Hkv, Dh] cache (donated: the
    decode loop writes its rows in place, so copying the buffers would distort the time)."""
    mask = cache_mask(lengths, block_mask, k_buf.shape[1])
    return decoder_layer(dcfg.target, layer, x, positions, rope_inv_freq(dcfg.target),
                         k_buf, v_buf, write_rows, mask)


@partial(jax.jit, static_argnames=("step", "n"))
def _head_topk(head: VocabHead, w: Array, h: Array, context: Array | None, state: Any,
               step: int, n: int) -> tuple[Array, Array]:
    """(c): ``head``'s candidates for drafter outputs h [B, K, d] at draft step ``step``,
    then the n best children per node: log q and candidate slots [B, K, n]."""
    cand = head(w, h, step, context, state)
    return jax.lax.top_k(jax.nn.log_softmax(cand.logits, axis=-1), n)


@jax.jit
def _noop(x: Array) -> Array:
    """The cheapest jitted call: its time is the dispatch overhead every piece pays."""
    return x + 1


@partial(jax.jit, static_argnames=("tree", "vocab_size", "children"))
def _tree_ops(root: Array, prompt: Array, out_tokens: Array, tree: TreeSpec,
              vocab_size: int, children: int):
    """(d): the builder with a trivial expand returning ``children`` ready-made candidates,
    then, for a tree with a lookup chain, the draft phase's search of the committed text
    (prompt [B, P] and output [B, N], none of it committed yet) and the graft.

    The candidates depend on the expanded tokens and positions so nothing constant-folds.
    """
    def expand(carry, tokens, positions, node_idx, ancestors, step):
        ids = (tokens[..., None] * 31 + jnp.arange(children) + 1) % vocab_size
        logits = -(jnp.arange(children, dtype=jnp.float32) + (tokens[..., None] % 3)
                   + 0.01 * positions[..., None])
        return carry + jnp.sum(node_idx), ids.astype(jnp.int32), logits

    built, carry = tree.build(expand, jnp.int32(0), root, None, 0.0, vocab_size)
    if tree.lookup:
        built, _ = graft_lookup(built, tree, prompt, out_tokens, jnp.zeros(root.shape, jnp.int32))
    return built, carry


@dataclasses.dataclass(frozen=True)
class Expansion:
    """One ``expand`` call of a draft step."""

    step: int  # the draft step t of the children it drafts (0: the root's)
    k: int  # frontier nodes expanded at once, the builder's padding included
    children: int  # candidates kept per node (the builder's top-k)

    @property
    def label(self) -> str:
        return f"t={self.step} K={self.k}"


def expansion_plan(tree: TreeSpec) -> list[Expansion]:
    """The expansions of one draft step, the root's first (see the module doc).

    Raises:
      ValueError: a DySpec tree, whose expansions depend on the drafter's probabilities.
    """
    if tree.kind == "chain":
        return [Expansion(t, 1, 1) for t in range(tree.depth)]
    if tree.kind == "eagle2":
        return [Expansion(0, 1, tree.top_k),
                *(Expansion(t, tree.top_k, tree.top_k) for t in range(1, tree.depth))]
    if tree.kind == "static":  # one call a level, each as wide as the widest (build_static)
        paths = tree.paths  # normalized (breadth first, validated) when the spec was made
        levels = range(max(map(len, paths)))
        width = max(len({q[:-1] for q in paths if len(q) == d + 1}) for d in levels)
        return [Expansion(d, width, 1 + max(q[-1] for q in paths if len(q) == d + 1))
                for d in levels]
    raise ValueError(f"the breakdown needs a fixed expansion plan (chain, eagle2 or static "
                     f"trees); a {tree.kind} tree expands a data-dependent number of nodes: "
                     "time its draft phase whole with `specjax bench spec --tree-json ...`")


def drafter_parts(target: Target, drafter: Drafter, k: int, *, context: int, capacity: int,
                  workspace: int, runs: int) -> dict[str, dict[str, float]]:
    """Timings (:func:`time_calls`) of (a) and (b) for one expansion of ``k`` nodes."""
    cfg, d = target.cfg, target.cfg.hidden_size
    dtype = target.params.embed.dtype
    tokens = jnp.asarray((np.arange(k)[None] * 7919 + 11) % cfg.vocab_size, jnp.int32)
    feats = random_features((1, k, d), dtype)
    dparams = in_target_layout(drafter.params, target.params)  # as generate runs it
    a = time_calls(lambda: _embed_fc(target.params.embed, dparams, tokens, feats), runs)

    workspace = max(workspace, k + 1)
    cache = init_drafter_cache(drafter.cfg, 1, capacity, dtype)
    lengths = jnp.full((1,), context, jnp.int32)
    slots = np.arange(k)[None] + 1  # a beam: slots past the root
    # Each node sees the root and itself (a level-1 beam); the cost is the same for any mask.
    block = np.zeros((1, k, workspace), bool)
    block[:, :, 0] = True
    block[0, np.arange(k), slots[0]] = True
    block = jnp.asarray(block)
    positions = jnp.full((1, k), context + 1, jnp.int32)
    write_rows = jnp.asarray(context + slots, jnp.int32)
    bufs = {"k": list(cache.k), "v": list(cache.v)}

    def layer() -> Array:  # every drafter layer, in order
        h = feats
        for i, lp in enumerate(dparams.layers):
            h, bufs["k"][i], bufs["v"][i] = _drafter_layer(lp, drafter.cfg, h, positions,
                                                           bufs["k"][i], bufs["v"][i], lengths,
                                                           block, write_rows)
        return h

    return {"embed_fc": a, "layer": time_calls(layer, runs)}


def head_part(target: Target, drafter: Drafter, head: VocabHead, e: Expansion, *,
              runs: int) -> dict[str, float]:
    """Timing (:func:`time_calls`) of (c) for expansion ``e``: ``head`` at step ``e.step``
    over ``e.k`` drafter outputs, then the top ``e.children`` of each."""
    dtype = target.params.embed.dtype
    tokens = jnp.asarray((np.arange(e.k)[None] * 7919 + 11) % target.cfg.vocab_size,
                         jnp.int32)
    h = random_features((1, e.k, target.cfg.hidden_size), dtype)
    # A router head reads the drafter fc's input, built as the draft phase builds it.
    context = (drafter.cfg.router_context(target.params.embed, tokens,
                                          random_features((1, e.k, drafter.cfg.width), dtype,
                                                          seed=1))
               if head.uses_context else None)
    state = head.init_state(1) if head.stateful else None
    return time_calls(lambda: _head_topk(head, target.params.head, h, context, state,
                                         e.step, e.children), runs)


def run_breakdown(model_dir: str | Path, drafter_dir: str | Path | None, *,
                  tree: TreeSpec | str | None = None, vocab: str | VocabHead = "full",
                  out: str | Path = "results/bench_breakdown.json", context: int = 256,
                  max_new_tokens: int = 128, runs: int = 10, dtype: str | None = None,
                  drafter: Drafter | None = None) -> dict[str, Any]:
    """Time one draft step piece by piece; write ``out`` (JSON) and a stacked bar PNG.

    Args:
      model_dir: a converted target folder.
      drafter_dir: a drafter folder; None for the shipped one; "random" for an untrained
        one (the timings do not depend on the weights).
      tree: a chain, EAGLE-2 or static tree, with or without a lookup chain (default
        ``TreeSpec()``); e.g. the one ``specjax bench spec`` chose; ``"default"``: the
        drafter's measured greedy tree (:func:`resolve_tree`).
      vocab: the drafter's vocabulary head, as ``--vocab`` names it (default: full).
      context: committed cache rows; the cache is allocated as decoding a ``context``-token
        prompt with ``max_new_tokens`` would allocate it.
      runs: timed calls per micro-benchmark (best of them is reported).
      drafter: internal: an already loaded drafter.
    Returns:
      The dict written to ``out``: ``per_expansion`` lists the plan's expansions in order,
      each with its pieces in ms and ``in_draft_phase`` (the root's: its head only).
    """
    if tree is not None and tree != DRAFTER_DEFAULT:
        expansion_plan(tree)  # refuse a DySpec tree before loading anything
    out = Path(out)
    target = specjax.load(model_dir, dtype)
    if drafter is not None:
        drafter_name = str(drafter.path) if drafter.path is not None else "in-memory"
    else:
        drafter, drafter_name = resolve_drafter(drafter_dir, target)
    tree = resolve_tree(tree, drafter)
    plan = expansion_plan(tree)
    head = resolve_head(vocab, target, drafter)
    # Rows allocated as generate() would for a `context`-token prompt: attention runs over
    # all of them (masked), so the capacity, not the committed length, sets its cost.
    ctx, capacity = context, cache_capacity(context, max_new_tokens, tree)
    later_ks = sorted({e.k for e in plan[1:]})
    # (c) differs between expansions only through the head's capacity at their step.
    head_keys = {e: (head.capacity(e.step), e.k, e.children) for e in plan}

    bar = tqdm(total=len(later_ks) + len(set(head_keys.values())) + 4 + bool(tree.lookup),
               unit="bench")
    one = jnp.zeros((1,), jnp.float32)
    dispatch = time_calls(lambda: _noop(one), max(runs, 20))["best_ms"]
    timed: dict[str, dict[Any, dict[str, float]]] = {"embed_fc": {}, "layer": {},
                                                     "head_topk": {}}
    for k in later_ks:
        bar.set_description(f"drafter K={k}")
        for part, t in drafter_parts(target, drafter, k, context=ctx, capacity=capacity,
                                     workspace=tree.workspace, runs=runs).items():
            timed[part][k] = t
        bar.update()
    for e, key in head_keys.items():
        if key not in timed["head_topk"]:
            bar.set_description(f"head {e.label}")
            timed["head_topk"][key] = head_part(target, drafter, head, e, runs=runs)
            bar.update()
    bar.set_description("tree ops")
    root = jnp.full((1,), 11 % target.cfg.vocab_size, jnp.int32)
    prompt = jnp.zeros((1, ctx), jnp.int32)  # as draft_latency's state holds it
    out_tokens = jnp.full((1, bucket(max_new_tokens)), PAD, jnp.int32)
    tree_ops = time_calls(lambda: _tree_ops(root, prompt, out_tokens, tree,
                                            target.cfg.vocab_size,
                                            max(e.children for e in plan)), runs)
    tree_ops["best_ms"] = max(tree_ops["best_ms"] - dispatch, 0.0)
    bar.update()
    bar.set_description("draft phase")
    draft = draft_latency(target, drafter, tree, context=ctx, capacity=capacity,
                          out_len=bucket(max_new_tokens), runs=runs, head=head)
    bar.update()
    bar.set_description(f"verify T={tree.num_nodes}")
    verify = verify_latency(target, tree.num_nodes, context=ctx, capacity=capacity, runs=runs)
    bar.update()
    # A step whose lookup found no match verifies the builder's tree alone (verify_phase).
    unchained = tree.builder.num_nodes(tree)
    if tree.lookup:
        bar.set_description(f"verify T={unchained} (no chain)")
        verify_alone = verify_latency(target, unchained, context=ctx, capacity=capacity,
                                      runs=runs)
        bar.update()
    bar.set_description("vanilla T=1")
    vanilla = verify_latency(target, 1, context=ctx, capacity=capacity, runs=runs)
    bar.update()
    bar.close()

    def net(t: dict[str, float] | None) -> float:  # a separate jit's dispatch is paid once
        return 0.0 if t is None else max(t["best_ms"] - dispatch, 0.0)

    per_expansion = []
    for i, e in enumerate(plan):
        t = {"embed_fc": timed["embed_fc"].get(e.k) if i else None,
             "layer": timed["layer"].get(e.k) if i else None,
             "head_topk": timed["head_topk"][head_keys[e]]}
        per_expansion.append({
            "label": e.label + (" (root)" if i == 0 else ""), "step": e.step, "k": e.k,
            "children": e.children, "capacity": head_keys[e][0],
            "in_draft_phase": list(PARTS) if i else ["head_topk"],
            **{f"{p}_ms": net(t[p]) for p in PARTS},
            "raw_best_ms": {p: t[p]["best_ms"] for p in PARTS if t[p] is not None},
            "median_ms": {p: t[p]["median_ms"] for p in PARTS if t[p] is not None}})
    step = {f"{p}_ms": sum(x[f"{p}_ms"] for x in per_expansion) for p in PARTS}
    step["tree_ops_ms"] = tree_ops["best_ms"]
    accounted = sum(step.values())
    step["other_ms"] = draft["best_ms"] - accounted
    step["measured_ms"] = draft["best_ms"]
    step["measured_median_ms"] = draft["median_ms"]
    step["fractions"] = {p: step[f"{p}_ms"] / draft["best_ms"]
                         for p in (*PARTS, "tree_ops", "other")}
    result = {
        "benchmark": "breakdown", "model": str(model_dir), "model_name": Path(model_dir).name,
        "drafter": drafter_name, "dtype": str(target.params.embed.dtype),
        "vocab_size": target.cfg.vocab_size, "hidden_size": target.cfg.hidden_size,
        "vocab": head.name, "tree": tree_dict(tree), "tree_label": tree_label(tree),
        "batch": 1, "context": ctx, "capacity": capacity, "runs": runs,
        "machine": machine_info(), "per_expansion": per_expansion, "draft_step": step,
        "verify_ms": verify["best_ms"], "verify_tokens": tree.num_nodes,
        "verify_unchained_ms": verify_alone["best_ms"] if tree.lookup else None,
        "verify_unchained_tokens": unchained,
        "vanilla_forward_ms": vanilla["best_ms"],
        "draft_to_verify": draft["best_ms"] / verify["best_ms"],
        "parts": {p: PART_LABELS[p] for p in (*PARTS, "tree_ops", "other")},
        "dispatch_ms": dispatch,
        "timing": "best of `runs` jitted calls after a compile call, B=1; each piece net of "
                  "dispatch_ms (one trivial jitted call), which the fused draft phase pays "
                  "once; the root's (a) and (b) run in the previous step's catch-up, not "
                  "here",
    }
    write_json(out, result)
    plot_breakdown(result, out.with_suffix(".png"))
    print(summary(result))
    return result


def plot_breakdown(r: dict[str, Any], path: Path) -> Path:
    """Stacked bars: each expansion of the plan (left); the whole draft step vs verify
    (right)."""
    plt = pyplot()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.8),
                                   gridspec_kw={"width_ratios": [1, 1.3]})
    rows = r["per_expansion"]
    names = [x["label"].replace(" (root)", "\n(root)") for x in rows]
    bottom = [0.0] * len(rows)
    for p in PARTS:
        vals = [x[f"{p}_ms"] for x in rows]
        ax1.bar(names, vals, bottom=bottom, color=COLORS[p], label=PART_LABELS[p])
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, total in enumerate(bottom):
        ax1.text(i, total, f"{total:.2f} ms", ha="center", va="bottom", fontsize=8)
    ax1.set_ylabel("ms")
    ax1.set_title("The draft step's expansions (the root's: its head only)", fontsize=10)
    ax1.legend(fontsize=7)

    s = r["draft_step"]
    labels = [f"draft step\n({len(rows)} expansions)", f"verify\nT={r['verify_tokens']}",
              "vanilla\nT=1"]
    base = 0.0
    for p in (*PARTS, "tree_ops", "other"):
        v = max(s[f"{p}_ms"], 0.0)  # a negative remainder (fusion savings) is not drawn
        ax2.bar(labels[0], v, bottom=base, color=COLORS[p], label=PART_LABELS[p])
        if v / max(s["measured_ms"], 1e-9) > 0.06:
            ax2.text(0, base + v / 2, f"{100 * s['fractions'][p]:.0f}%", ha="center",
                     va="center", fontsize=8, color="white")
        base += v
    ax2.bar(labels[1], r["verify_ms"], color=COLORS["verify"], label="target forward + head")
    ax2.bar(labels[2], r["vanilla_forward_ms"], color=COLORS["verify"])
    for i, v in enumerate((s["measured_ms"], r["verify_ms"], r["vanilla_forward_ms"])):
        ax2.text(i, max(v, base if i == 0 else v), f"{v:.1f} ms", ha="center", va="bottom",
                 fontsize=8)
    ax2.set_ylabel("ms")
    ax2.margins(y=0.12)
    ax2.set_title(f"Draft step ({r['tree_label']}, {r['vocab']}) vs target forward",
                  fontsize=10)
    ax2.legend(fontsize=7)
    fig.suptitle(f"{r['model_name']} (V={r['vocab_size']}, d={r['hidden_size']}), B=1, cache "
                 f"{r['context']}/{r['capacity']} rows, {r['machine']['nproc']} CPUs",
                 fontsize=10)
    return save_figure(fig, path)


def summary(r: dict[str, Any]) -> str:
    """A human-readable table of one breakdown."""
    rows = r["per_expansion"]
    lines = [f"{r['model_name']} (V={r['vocab_size']}), drafter {r['drafter']}, tree "
             f"{r['tree_label']}, head {r['vocab']}, cache {r['context']}/{r['capacity']} "
             f"rows, B=1 (best of {r['runs']}, ms)",
             f"{'':<34}" + "".join(f"{x['label']:>16}" for x in rows)]
    for p in PARTS:
        lines.append(f"{PART_LABELS[p]:<34}" + "".join(
            f"{x[f'{p}_ms']:>16.3f}" if p in x["in_draft_phase"] else f"{'catch-up':>16}"
            for x in rows))
    s = r["draft_step"]
    lines.append(f"draft step = {len(rows)} expansion{'s' * (len(rows) > 1)} (the root's head "
                 "only) + tree ops:")
    for p in (*PARTS, "tree_ops", "other"):
        lines.append(f"  {PART_LABELS[p]:<32}{s[f'{p}_ms']:>10.3f}"
                     f"{100 * s['fractions'][p]:>8.1f}%")
    lines.append(f"  {'measured draft phase':<32}{s['measured_ms']:>10.3f}")
    lines.append(f"(pieces are net of {r['dispatch_ms']:.3f} ms, the dispatch cost of one "
                 "jitted call; 'catch-up': the root's fc and layers run in the previous "
                 "step's verify phase)")
    alone = (f" (without the lookup chain, T={r['verify_unchained_tokens']}: "
             f"{r['verify_unchained_ms']:.3f} ms)" if r["verify_unchained_ms"] else "")
    lines.append(f"target verify forward T={r['verify_tokens']}: {r['verify_ms']:.3f} ms"
                 f"{alone}; vanilla T=1: {r['vanilla_forward_ms']:.3f} ms; draft / verify = "
                 f"{r['draft_to_verify']:.2f}")
    return "\n".join(lines)


def tree_from_spec_json(path: str | Path) -> TreeSpec:
    """The tree a ``specjax bench spec`` result chose (its lookup chain included)."""
    return TreeSpec.from_json(json.loads(Path(path).read_text())["tree"])


def add_breakdown_args(p: argparse.ArgumentParser) -> None:
    """Attach ``specjax bench breakdown``'s flags to a (sub)parser."""
    p.add_argument("--model", default=None,
                   help="converted target folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None,
                   help="drafter folder (default: the shipped drafter); 'random' = untrained "
                        "weights (timings do not depend on them)")
    add_tree_args(p, auto=False, drafter_default=True)
    p.add_argument("--vocab", default="full",
                   help="the drafter's vocabulary head: full, fr:N, pafr:N, dynaspec, "
                        "evospec, ... (default: full)")
    p.add_argument("--from-spec", default=None, metavar="JSON",
                   help="use the tree a `specjax bench spec` result chose (overrides --tree)")
    p.add_argument("--context", type=int, default=256, help="committed cache rows (default 256)")
    p.add_argument("--runs", type=int, default=10, help="timed calls per piece (default 10)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="cast parameters at load (default: as stored)")
    p.add_argument("--out", default="results/bench_breakdown.json")


def run_breakdown_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Run :func:`run_breakdown` from :func:`add_breakdown_args`'s flags."""
    model = resolve_model(args.model)
    tree = tree_from_spec_json(args.from_spec) if args.from_spec else tree_from_args(args)
    return run_breakdown(model, args.drafter, tree=tree, vocab=args.vocab, out=Path(args.out),
                         context=args.context, runs=args.runs, dtype=args.dtype)


def add_parser(bench: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``breakdown`` to ``specjax bench``'s subparsers; ``args.run`` runs it."""
    p = bench.add_parser("breakdown",
                         help="time breakdown of one draft step (JSON + stacked bars)")
    add_breakdown_args(p)
    p.set_defaults(run=as_command(run_breakdown_from_args))
    return p
