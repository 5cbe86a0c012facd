"""``specjax bench trees``'s report: the plots and the printed table of one result (the dict
:func:`specjax.bench.tree_compare.run_tree_bench` writes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from specjax.bench.common import MAL_NOTE, dash, pyplot, save_figure


def plot_paths(out: Path) -> dict[str, Path]:
    """Where a run writing ``out`` puts its plots."""
    return {"mal": out.with_name(out.stem + "_mal.png"),
            "blocks": out.with_name(out.stem + "_blocks.png")}


def plot_mal(r: dict[str, Any], path: Path) -> Path:
    """MAL (top) and decode speed × vanilla (bottom) against T, one line per kind, one
    column per temperature."""
    plt = pyplot()
    temps = r["config"]["temperatures"]
    fig, axes = plt.subplots(2, len(temps), figsize=(5.5 * len(temps), 7.5), squeeze=False)
    for j, temp in enumerate(temps):
        for kind in r["config"]["kinds"]:
            rows = sorted((x for x in r["results"] if x["kind"] == kind
                           and x["temperature"] == temp), key=lambda x: x["budget"])
            ts = [x["budget"] for x in rows]
            for i, key in enumerate(("mal", "speedup_vs_vanilla")):
                ys = [np.nan if x[key] is None else x[key] for x in rows]
                axes[i, j].plot(ts, ys, "o-", label=kind)
        for i, (ylabel, title) in enumerate((
                ("MAL (tokens / target forward, bonus incl.)", "MAL against budget"),
                ("decode tokens/s ÷ paired vanilla runs", "speed × vanilla"))):
            ax = axes[i, j]
            ax.set_xscale("log", base=2)
            ax.set_xticks(r["config"]["budgets"], [str(t) for t in r["config"]["budgets"]])
            ax.axhline(1.0, color="k", lw=0.8, ls=":")
            ax.set_xlabel("T = drafted nodes per step (root excluded)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title}, temperature {temp:g}", fontsize=10)
            ax.legend(fontsize=8)
    eq = r["greedy_equality"]
    fig.suptitle(f"{r['model_name']} + drafter {Path(r['config']['drafter']).name}\n"
                 f"{len(r['prompts'])} Spec-Bench prompts, {r['config']['max_new_tokens']} "
                 f"new tokens; greedy equal {eq['matched']}/{eq['checked']}; "
                 f"{r['machine']['nproc']} CPUs", fontsize=9)
    return save_figure(fig, path)


def plot_blocks(r: dict[str, Any], path: Path) -> Path:
    """Mean non-empty mask tiles per drafted tree, BFS against DFS, per block size; bar
    labels give the ratio BFS / DFS. One group per (kind, T, temperature) counted."""
    plt = pyplot()
    rows = [x for x in r["results"] if x["mask_blocks"]]
    blocks = r["config"]["blocks"]
    fig, axes = plt.subplots(len(blocks), 1, figsize=(max(7.0, 0.55 * len(rows) + 2), 3.6
                                                      * len(blocks)), squeeze=False)
    xs = np.arange(len(rows))
    labels = [f"{x['kind']} T{x['budget']}" + (f" t{x['temperature']:g}"
                                                if len(r["config"]["temperatures"]) > 1 else "")
              for x in rows]
    for i, blk in enumerate(blocks):
        ax = axes[i, 0]
        k = f"block{blk}"
        bfs = [x["mask_blocks"][k]["bfs"] for x in rows]
        dfs = [x["mask_blocks"][k]["dfs"] for x in rows]
        ax.bar(xs - 0.2, bfs, 0.4, label="BFS layout")
        bars = ax.bar(xs + 0.2, dfs, 0.4, label="DFS order")
        ax.bar_label(bars, labels=[f"{x['mask_blocks'][k]['ratio']:.2f}" for x in rows],
                     fontsize=7)
        # What any layout could reach: n query blocks need at least the root's column and
        # the diagonal (2n - 1 tiles); a causal mask has n(n + 1) / 2.
        n = np.asarray([-(-x["tree"]["num_nodes"] // blk) for x in rows])
        ax.plot(xs, 2 * n - 1, "k_", ms=14, mew=2, label="fewest possible (2n-1)")
        ax.plot(xs, n * (n + 1) / 2, "_", color="tab:gray", ms=14, mew=2,
                label="causal (n(n+1)/2)")
        ax.set_xticks(xs, labels, rotation=40, ha="right", fontsize=7)
        ax.set_ylabel("non-empty tiles per tree")
        ax.set_title(f"Mask blocks of drafted trees, block {blk} (labels: BFS / DFS)",
                     fontsize=10)
        ax.legend(fontsize=8)
    if not rows:
        axes[0, 0].text(0.5, 0.5, "no block pass in this run", ha="center")
    return save_figure(fig, path)


def _tiles_text(mb: dict[str, Any] | None, block: int) -> str:
    if not mb:
        return "-"
    return f"{mb[f'block{block}']['bfs']:.1f}/{mb[f'block{block}']['dfs']:.1f}"


def summary(r: dict[str, Any]) -> str:
    """A human-readable table of one result."""
    blocks = r["config"]["blocks"]
    lines = [f"{r['model_name']}, drafter {r['config']['drafter']}, {len(r['prompts'])} "
             f"prompts, {r['config']['max_new_tokens']} new tokens, batch 1",
             f"{'temp':>5}{'T':>4} {'tree':<28}{'MAL*':>6}{'size':>6}{'tok/s':>7}{'x van':>7}"
             f"{'greedy':>8}" + "".join(f"{f'b{b} bfs/dfs':>15}" for b in blocks)]
    for x in r["results"]:
        mb = x["mask_blocks"]
        lines.append(
            f"{x['temperature']:>5g}{x['budget']:>4} {x['label']:<28}{dash(x['mal']):>6}"
            f"{dash(x['mean_tree_size'], '.1f'):>6}{dash(x['decode_tokens_per_s'], '.1f'):>7}"
            f"{dash(x['speedup_vs_vanilla']):>7}"
            + (f"{x['greedy_matched']:>5}/{x['greedy_checked']:<2}" if x["greedy_checked"]
               else f"{'-':>8}")
            + "".join(f"{_tiles_text(mb, b):>15}" for b in blocks))
    lines.append("* " + MAL_NOTE + "; size = mean valid nodes per step, root included")
    lines.append("vanilla decode tokens/s: " + ", ".join(
        f"{k}: {dash(v, '.1f')}" for k, v in r["vanilla_decode_tokens_per_s"].items()))
    for c in r["threshold_selection"]["per_budget"]:
        lines.append(f"dyspec-threshold T={c['budget']} t={c['temperature']:g}: chose "
                     f"{c['chosen_threshold']:g} from " + ", ".join(
                         f"{g['threshold']:g} ({dash(g['decode_tokens_per_s'], '.1f')} tok/s, "
                         f"MAL {g['mal']:.2f}, size {g['mean_tree_size']:.1f}, calls "
                         f"{dash(g.get('drafter_calls'), '.1f')})" for g in c["grid"]))
    lines.append("best budget by tokens/s ÷ paired vanilla: " + "; ".join(
        f"{b['kind']} t{b['temperature']:g}: T={b['budget']} "
        f"({dash(b['decode_tokens_per_s'], '.1f')} tok/s, {dash(b['speedup_vs_vanilla'])}x)"
        for b in r["best_budget"]))
    large = r["mask_blocks"]["trees_of_32_nodes_or_more"]
    if large:
        lines.append("trees of 32+ nodes, BFS/DFS tiles: " + ", ".join(
            f"{k}: {v['ratio']:.2f}x" for k, v in large.items()))
    if r["timed_compiles"]:
        lines.append(f"warning: {r['timed_compiles']} XLA compiles happened inside timed "
                     "calls (recompiles); those prompts' times include them")
    eq = r["greedy_equality"]
    if eq["all_match"]:
        lines.append(f"greedy equality: all {eq['checked']} greedy runs match vanilla")
    else:
        lines.append(f"!!! greedy equality: {eq['matched']}/{eq['checked']} match; mismatches: "
                     + ", ".join(f"q{m['question_id']} {m['label']}@{m['first_mismatch']}"
                                 for m in eq["mismatches"]) + " !!!")
    return "\n".join(lines)
