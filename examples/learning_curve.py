"""Held-out top-1 (or ``--metric accept``) against tokens seen (log scale) for one or more
drafter training runs.

Each run is a drafter folder (or a checkpoint folder) holding ``training_log.json``; its
x axis counts the tokens its starting drafter had seen (``prior_tokens_seen``), so a
fine-tune continues its source's curve. Runs compared on one plot should share a held-out
split (the same cache, or caches of the same data), or their levels are not comparable.

    python examples/learning_curve.py drafter4a drafter5a drafter5t \\
        --label "1 layer" --label "+2 epochs" --label "+2 epochs, taps 1,14" \\
        --out docs/img/smollm2_drafter_s15_curve.png

``--metric accept`` plots the held-out ``sum_x min(p, q)`` instead: the probability that a
draft sampled at temperature 1 is accepted (logged since the forty-third session; older
runs have no such records and are refused).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

METRICS = {"top1": "held-out top-1 (whole vocabulary)",
           "accept": "held-out sum min(p, q) (a sampled draft's acceptance, T = 1)"}


def curve(folder: Path, metric: str = "top1") -> tuple[list[int], list[float]]:
    """(tokens seen in all, the held-out ``metric``) at each evaluation of the run in
    ``folder``."""
    log = json.loads((folder / "training_log.json").read_text())
    prior = log.get("meta", {}).get("prior_tokens_seen")
    if prior is None:  # a checkpoint folder's log has no meta: read its source's
        src = log["train_config"].get("init_from")
        prior = 0 if not src else json.loads(
            (Path(src) / "training_log.json").read_text())["meta"]["tokens_seen_total"]
    if any(metric not in r for r in log["eval"]):
        raise SystemExit(f"{folder}: its evaluations have no {metric!r} (a run logged before "
                         "it existed); plot --metric top1")
    return ([prior + r["tokens_seen"] for r in log["eval"]],
            [r[metric] for r in log["eval"]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="drafter or checkpoint folders")
    ap.add_argument("--label", action="append", default=[], help="one per run, in order")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    ap.add_argument("--metric", choices=sorted(METRICS), default="top1",
                    help="what to plot (default top1)")
    args = ap.parse_args()
    if args.label and len(args.label) != len(args.runs):
        ap.error(f"{len(args.label)} labels for {len(args.runs)} runs")
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, run in enumerate(args.runs):
        x, y = curve(run, args.metric)
        ax.plot(x, y, marker="o", ms=3, label=args.label[i] if args.label else run.name)
        print(f"{run}: {x[0]:,} -> {x[-1]:,} tokens, held-out {args.metric} "
              f"{y[0]:.4f} -> {y[-1]:.4f}")
    ax.set_xscale("log")
    ax.set_xlabel("tokens seen (the starting drafter's included)")
    ax.set_ylabel(METRICS[args.metric])
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
