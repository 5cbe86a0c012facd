"""``specjax bench breakdown``: where the time of one draft step goes (cf. FR-Spec, fig. 6).

One expansion of ``K`` frontier nodes by the EAGLE drafter is, in order:

(a) the embedding gather of the K tokens and ``fc`` over [embedding; feature] ([K, 2d] x
    [2d, d]);
(b) the drafter's decoder layer: attention over a realistic cache (every allocated row,
    masked, as in decoding) plus the MLP;
(c) the LM head over the full vocabulary ([K, d] x [V, d]^T) plus the children's log-softmax
    and top-k, which the tree builder runs on the head's logits.

A whole draft step is one expansion of the root (K = 1) and then, for EAGLE-2, ``depth - 1``
expansions of a ``top_k`` beam (a chain: ``depth`` expansions of K = 1), plus

(d) the tree builder's own work (beam / pool selection, layout, ancestor masks), timed by
    running the builder with a trivial ``expand`` that returns precomputed top-k candidates,
    so (c)'s vocabulary-wide work is not counted twice;

and an "other" remainder: the measured jitted draft phase minus the sum above (the per-node
feature gather and scatter of the real ``expand``, and what separate jits cannot fuse; it
can come out slightly negative, since fusing the pieces also saves work).

Every piece is a separate jitted micro-benchmark at B=1 on the real target and drafter,
best of ``runs`` calls after a compile call. The target's verify forward over the tree's T
nodes (and a vanilla T=1 forward) are timed too, for scale. Output: JSON + stacked bar PNG.
"""

from __future__ import annotations

import argparse
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
from specjax.bench.common import as_command, machine_info, save_figure, write_json
from specjax.bench.phases import draft_latency, random_features, resolve_drafter
from specjax.bench.timing import time_calls, verify_latency
from specjax.bench.trees import add_tree_args, tree_dict, tree_from_args, tree_label
from specjax.defaults import resolve_model
from specjax.drafter import (
    DrafterConfig,
    DrafterParams,
    fc_input,
    in_target_layout,
    init_drafter_cache,
)
from specjax.loaded import Drafter, Target
from specjax.loop import bucket
from specjax.model import (
    FusedLayerParams,
    LayerParams,
    Params,
    cache_mask,
    decoder_layer,
    lm_head,
    rope_inv_freq,
)
from specjax.speculative import TreeSpec, cache_capacity

PARTS = ("embed_fc", "layer", "head_topk")
PART_LABELS = {"embed_fc": "(a) embedding gather + fc", "layer": "(b) drafter decoder layer",
               "head_topk": "(c) LM head (full vocab) + top-k", "tree_ops": "(d) tree ops",
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


@partial(jax.jit, static_argnames=("n",))
def _head_topk(head: Array, h: Array, n: int) -> tuple[Array, Array]:
    """(c): [B, K, d] x head [V, d] -> the n best children per node: log q and ids [B, K, n].

    Takes the head alone (as :func:`specjax.model.lm_head` computes it), not the target's
    whole parameter pytree, whose hundreds of leaves would add dispatch time.
    """
    logits = lm_head(Params(embed=head, layers=(), final_norm=head[0]), h)
    return jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), n)


@jax.jit
def _noop(x: Array) -> Array:
    """The cheapest jitted call: its time is the dispatch overhead every piece pays."""
    return x + 1


@partial(jax.jit, static_argnames=("tree", "vocab_size"))
def _tree_ops(root: Array, tree: TreeSpec, vocab_size: int):
    """(d): the builder with a trivial expand returning C = top_k ready-made candidates.

    The candidates depend on the expanded tokens and positions so nothing constant-folds.
    """
    c = tree.top_k if tree.kind == "eagle2" else 1

    def expand(carry, tokens, positions, node_idx, ancestors, step):
        ids = (tokens[..., None] * 31 + jnp.arange(c) + 1) % vocab_size
        logits = -(jnp.arange(c, dtype=jnp.float32) + (tokens[..., None] % 3)
                   + 0.01 * positions[..., None])
        return carry + jnp.sum(node_idx), ids.astype(jnp.int32), logits

    return tree.build(expand, jnp.int32(0), root, None, 0.0, vocab_size)


def expansion_counts(tree: TreeSpec) -> dict[int, int]:
    """{K: number of expansions with K frontier nodes} of one draft step."""
    if tree.kind == "chain":
        return {1: tree.depth}
    if tree.kind == "eagle2":
        counts = {1: 1}
        if tree.depth > 1:
            counts[tree.top_k] = counts.get(tree.top_k, 0) + tree.depth - 1
        return counts
    raise ValueError("the breakdown supports chain and eagle2 trees")


def expansion_parts(target: Target, drafter: Drafter, k: int, n_children: int, *,
                    context: int, capacity: int, workspace: int, runs: int,
                    dispatch_ms: float = 0.0) -> dict[str, float]:
    """Best-of times (ms) of (a), (b), (c) for one expansion of ``k`` frontier nodes.

    ``dispatch_ms`` (a separate jitted call's fixed cost, which the fused draft phase pays
    once, not once per piece) is subtracted from each piece, down to 0.
    """
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

    b = time_calls(layer, runs)
    c = time_calls(lambda: _head_topk(target.params.head, feats, n_children), runs)
    net = {f"{p}_ms": max(t["best_ms"] - dispatch_ms, 0.0)
           for p, t in zip(PARTS, (a, b, c), strict=True)}
    return net | {"sum_ms": sum(net.values()),
                  "raw_best_ms": {p: t["best_ms"] for p, t in zip(PARTS, (a, b, c),
                                                                   strict=True)},
                  "median_ms": {p: t["median_ms"] for p, t in zip(PARTS, (a, b, c),
                                                                   strict=True)}}


def run_breakdown(model_dir: str | Path, drafter_dir: str | Path | None, *,
                  tree: TreeSpec | None = None,
                  out: str | Path = "results/bench_breakdown.json", context: int = 256,
                  max_new_tokens: int = 128, runs: int = 10, dtype: str | None = None,
                  drafter: Drafter | None = None) -> dict[str, Any]:
    """Time one draft step piece by piece; write ``out`` (JSON) and a stacked bar PNG.

    Args:
      model_dir: a converted target folder.
      drafter_dir: a drafter folder; None for the shipped one; "random" for an untrained
        one (the timings do not depend on the weights).
      tree: a chain or EAGLE-2 tree (default ``TreeSpec()``); e.g. the one
        ``specjax bench spec`` chose.
      context: committed cache rows; the cache is allocated as decoding a ``context``-token
        prompt with ``max_new_tokens`` would allocate it.
      runs: timed calls per micro-benchmark (best of them is reported).
      drafter: internal: an already loaded drafter.
    Returns:
      The dict written to ``out``.
    """
    tree = tree or TreeSpec()
    counts = expansion_counts(tree)
    out = Path(out)
    target = specjax.load(model_dir, dtype)
    if drafter is not None:
        drafter_name = str(drafter.path) if drafter.path is not None else "in-memory"
    else:
        drafter, drafter_name = resolve_drafter(drafter_dir, target)
    # Rows allocated as generate() would for a `context`-token prompt: attention runs over
    # all of them (masked), so the capacity, not the committed length, sets its cost.
    ctx, capacity = context, cache_capacity(context, max_new_tokens, tree)
    n_children = tree.top_k if tree.kind == "eagle2" else 1

    bar = tqdm(total=len(counts) + 4, unit="bench")
    one = jnp.zeros((1,), jnp.float32)
    dispatch = time_calls(lambda: _noop(one), max(runs, 20))["best_ms"]
    per_k = {}
    for k in counts:
        bar.set_description(f"expansion K={k}")
        per_k[k] = expansion_parts(target, drafter, k, n_children, context=ctx,
                                   capacity=capacity, workspace=tree.workspace, runs=runs,
                                   dispatch_ms=dispatch)
        bar.update()
    bar.set_description("tree ops")
    root = jnp.full((1,), 11 % target.cfg.vocab_size, jnp.int32)
    tree_ops = time_calls(lambda: _tree_ops(root, tree, target.cfg.vocab_size), runs)
    tree_ops["best_ms"] = max(tree_ops["best_ms"] - dispatch, 0.0)
    bar.update()
    bar.set_description("draft phase")
    draft = draft_latency(target, drafter, tree, context=ctx, capacity=capacity,
                          out_len=bucket(max_new_tokens), runs=runs)
    bar.update()
    bar.set_description(f"verify T={tree.num_nodes}")
    verify = verify_latency(target, tree.num_nodes, context=ctx, capacity=capacity, runs=runs)
    bar.update()
    bar.set_description("vanilla T=1")
    vanilla = verify_latency(target, 1, context=ctx, capacity=capacity, runs=runs)
    bar.update()
    bar.close()

    step = {f"{p}_ms": sum(n * per_k[k][f"{p}_ms"] for k, n in counts.items()) for p in PARTS}
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
        "tree": tree_dict(tree), "tree_label": tree_label(tree), "batch": 1,
        "context": ctx, "capacity": capacity, "runs": runs, "machine": machine_info(),
        "expansions": {str(k): n for k, n in counts.items()},
        "per_expansion": {f"K={k}": v for k, v in per_k.items()},
        "draft_step": step,
        "verify_ms": verify["best_ms"], "verify_tokens": tree.num_nodes,
        "vanilla_forward_ms": vanilla["best_ms"],
        "draft_to_verify": draft["best_ms"] / verify["best_ms"],
        "parts": {p: PART_LABELS[p] for p in (*PARTS, "tree_ops", "other")},
        "dispatch_ms": dispatch,
        "timing": "best of `runs` jitted calls after a compile call, B=1; each piece net of "
                  "dispatch_ms (one trivial jitted call), which the fused draft phase pays "
                  "once",
    }
    write_json(out, result)
    plot_breakdown(result, out.with_suffix(".png"))
    print(summary(result))
    return result


def plot_breakdown(r: dict[str, Any], path: Path) -> Path:
    """Stacked bars: one expansion per K (left); the whole draft step vs verify (right)."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot's import
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.8),
                                   gridspec_kw={"width_ratios": [1, 1.3]})
    names = list(r["per_expansion"])
    bottom = [0.0] * len(names)
    for p in PARTS:
        vals = [r["per_expansion"][n][f"{p}_ms"] for n in names]
        ax1.bar(names, vals, bottom=bottom, color=COLORS[p], label=PART_LABELS[p])
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, total in enumerate(bottom):
        ax1.text(i, total, f"{total:.2f} ms", ha="center", va="bottom", fontsize=8)
    ax1.set_ylabel("ms")
    ax1.set_title("One drafter expansion of K frontier nodes", fontsize=10)
    ax1.legend(fontsize=7)

    s = r["draft_step"]
    counts = ", ".join(f"{n}x K={k}" for k, n in r["expansions"].items())
    labels = [f"draft step\n({counts})", f"verify\nT={r['verify_tokens']}", "vanilla\nT=1"]
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
    ax2.set_title(f"Draft step ({r['tree_label']}) vs target forward", fontsize=10)
    ax2.legend(fontsize=7)
    fig.suptitle(f"{r['model_name']} (V={r['vocab_size']}, d={r['hidden_size']}), B=1, cache "
                 f"{r['context']}/{r['capacity']} rows, {r['machine']['nproc']} CPUs",
                 fontsize=10)
    return save_figure(fig, path)


def summary(r: dict[str, Any]) -> str:
    """A human-readable table of one breakdown."""
    lines = [f"{r['model_name']} (V={r['vocab_size']}), drafter {r['drafter']}, tree "
             f"{r['tree_label']}, cache {r['context']}/{r['capacity']} rows, B=1 (best of "
             f"{r['runs']}, ms)",
             f"{'':<34}" + "".join(f"{n:>10}" for n in r["per_expansion"])]
    for p in PARTS:
        lines.append(f"{PART_LABELS[p]:<34}" + "".join(
            f"{v[f'{p}_ms']:>10.3f}" for v in r["per_expansion"].values()))
    s = r["draft_step"]
    counts = ", ".join(f"{n} x K={k}" for k, n in r["expansions"].items())
    lines.append(f"draft step = {counts} expansions + tree ops:")
    for p in (*PARTS, "tree_ops", "other"):
        lines.append(f"  {PART_LABELS[p]:<32}{s[f'{p}_ms']:>10.3f}"
                     f"{100 * s['fractions'][p]:>8.1f}%")
    lines.append(f"  {'measured draft phase':<32}{s['measured_ms']:>10.3f}")
    lines.append(f"(pieces are net of {r['dispatch_ms']:.3f} ms, the dispatch cost of one "
                 "jitted call)")
    lines.append(f"target verify forward T={r['verify_tokens']}: {r['verify_ms']:.3f} ms; "
                 f"vanilla T=1: {r['vanilla_forward_ms']:.3f} ms; draft / verify = "
                 f"{r['draft_to_verify']:.2f}")
    return "\n".join(lines)


def tree_from_spec_json(path: str | Path) -> TreeSpec:
    """The tree a ``specjax bench spec`` result chose."""
    d = json.loads(Path(path).read_text())["tree"]
    return TreeSpec(kind=d["kind"], depth=d["depth"], top_k=d.get("top_k", TreeSpec.top_k),
                    total_tokens=d.get("total_tokens", TreeSpec.total_tokens))


def add_breakdown_args(p: argparse.ArgumentParser) -> None:
    """Attach ``specjax bench breakdown``'s flags to a (sub)parser."""
    p.add_argument("--model", default=None,
                   help="converted target folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None,
                   help="drafter folder (default: the shipped drafter); 'random' = untrained "
                        "weights (timings do not depend on them)")
    add_tree_args(p, auto=False)
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
    return run_breakdown(model, args.drafter, tree=tree, out=Path(args.out),
                         context=args.context, runs=args.runs, dtype=args.dtype)


def add_parser(bench: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``breakdown`` to ``specjax bench``'s subparsers; ``args.run`` runs it."""
    p = bench.add_parser("breakdown",
                         help="time breakdown of one draft step (JSON + stacked bars)")
    add_breakdown_args(p)
    p.set_defaults(run=as_command(run_breakdown_from_args))
    return p
