"""Speculative against vanilla decoding when *sampling*: several trees paired, or on
calibration prompts.

The shipped tree for sampling on the Spec-Bench prompts is one command,
``specjax bench spec --temperature 1.0`` (the same draws: one seed a prompt, no EOS stop;
the speedup's interval over prompts), and ``--add-tree JSON`` there runs candidates paired
against it on calibration prompts and evaluates the winner. This script keeps the finer
controls for choosing that tree: several prompt sets (``--skip``), a split by prompt length
(``--length-split``), vanilla beside every tree, Spec-Bench itself. When sampling,
outputs differ run to run (only their distribution is the target's, which the chi-square
tests check), so it compares speed alone: for each prompt, vanilla and
speculative decoding (the tree and head generate drafts at that temperature unless given)
draw ``--max-new-tokens`` tokens at ``--temperature`` without stopping at EOS, and the
decode rates (compile excluded, ``decode_tokens_per_s``) are pooled over the prompts, in
one run.

    python examples/sampled_speedup.py --temperature 1.0 --out results/sampled_speedup.json

``--calibration N`` runs about N calibration prompts instead (ShareGPT's calibration range,
never Spec-Bench: :func:`specjax.bench.questions.calibration_prompts`, whose prompt mix
rounds each kind's share), for choosing a tree before it is evaluated once on Spec-Bench;
``--long-share 0.333 --max-prompt-tokens 1024`` gives them Spec-Bench's mix of lengths (a
third give a 450-1,000-token text to summarize or answer from), as
``sampled_tree_calibration.py`` draws them.

``--tree-json`` given more than once compares the trees in one run: each prompt runs
vanilla and then every tree in turn with the same seed (the order rotated from prompt to
prompt, :func:`specjax.bench.paired.paired_runs`), so the machine's drift between runs
(often larger than the differences between trees) falls on all of them alike. The JSON
then holds one result per tree under ``trees``, each after the first with its speed
relative to the first and a 95% interval over prompts (``vs_first``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import specjax
from specjax.bench.common import ratio_of_sums, write_json
from specjax.bench.paired import paired_runs, relative_speed
from specjax.bench.questions import CALIB_SKIP, TASKS, calibration_prompts, spec_bench_prompts
from specjax.defaults import resolve_model, shipped_drafter_for
from specjax.train.prompts import with_long_share
from specjax.tree import TreeSpec


def pooled(rows: list[dict]) -> dict:
    """One tree's prompts pooled: tokens over summed decode seconds (so long prompts weigh
    by their tokens), the speedup as the ratio of the summed times with a 95% interval that
    resamples whole prompts (``speedup_ci95``), MAL and the chained fraction (steps that
    verified a lookup chain) averaged over prompts."""
    tok = sum(r["tokens"] for r in rows)
    van = np.array([r["vanilla_decode_s"] for r in rows])
    spec = np.array([r["spec_decode_s"] for r in rows])
    speedup, ci = ratio_of_sums(van, spec)
    return {"prompts": len(rows), "vanilla_tokens_per_s": tok / van.sum(),
            "spec_tokens_per_s": tok / spec.sum(), "speedup": speedup, "speedup_ci95": ci,
            "mal": sum(r["mal"] for r in rows) / len(rows),
            "chained_fraction": sum(r["chained_fraction"] for r in rows) / len(rows)}


def by_length(rows: list[dict], base: list[dict], split: int) -> dict:
    """:func:`relative_speed` apart for prompts shorter than ``split`` tokens and for the
    rest (a tree's extra draft level and verify rows cost more over a long context, where
    its extra accepted tokens may also differ); a side with no prompts is left out."""
    out = {}
    for name, keep in [(f"under {split}", lambda n: n < split),
                       (f"{split} and over", lambda n: n >= split)]:
        idx = [i for i, r in enumerate(base) if keep(r["prompt_tokens"])]
        if idx:
            out[name] = {"prompts": len(idx),
                         **relative_speed([rows[i] for i in idx], [base[i] for i in idx])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="converted target folder or a named model, e.g. gemma3-270m (its "
                         "shipped drafter drafts; default: SmolLM2-135M-Instruct)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="nucleus filtering of every draw (default 1: off)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--per-task", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tree-json", action="append", default=None, metavar="JSON",
                    help="a TreeSpec as JSON, e.g. '{\"kind\": \"eagle2\", \"depth\": 1, "
                         "\"top_k\": 1, \"total_tokens\": 1}' (default: the drafter's "
                         "shipped tree); repeat it to compare trees prompt by prompt")
    ap.add_argument("--calibration", type=int, default=0, metavar="N",
                    help="about N calibration prompts instead of Spec-Bench's (default 0: "
                         "Spec-Bench)")
    ap.add_argument("--long-share", type=float, default=0.0, metavar="F",
                    help="with --calibration: share of prompts that give a long text "
                         "(450-1,000 tokens) to summarize or answer from, as "
                         "sampled_tree_calibration.py's (default 0)")
    ap.add_argument("--skip", type=int, default=CALIB_SKIP, metavar="R",
                    help="with --calibration: the ShareGPT record the prompts start from "
                         f"(default {CALIB_SKIP}, the calibration range's start; a later one "
                         "gives a second, disjoint set to confirm a choice on)")
    ap.add_argument("--max-prompt-tokens", type=int, default=320,
                    help="with --calibration: the longest prompt taken (default 320)")
    ap.add_argument("--length-split", type=int, default=0, metavar="N",
                    help="with several trees: each one's speed against the first apart for "
                         "prompts under N tokens and for the rest")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args()
    try:  # refused before the model loads
        trees = [TreeSpec.from_json_text(t) for t in args.tree_json or ()]
    except ValueError as e:
        ap.error(str(e))
    if not 0 <= args.long_share <= 1:
        ap.error(f"--long-share must be in [0, 1], got {args.long_share}")
    target = specjax.load(resolve_model(args.model, progress=False))
    folder = shipped_drafter_for(target.cfg)
    if folder is None:
        ap.error(f"no drafter is shipped for {args.model}")
    drafter = specjax.load_drafter(folder, target)
    if args.calibration:
        ids, _ = calibration_prompts(target, num=args.calibration,
                                     weights=with_long_share(args.long_share),
                                     max_prompt_tokens=args.max_prompt_tokens,
                                     skip=args.skip)
        evals = [{"task": "calibration", "ids": p} for p in ids]
    else:
        evals, _ = spec_bench_prompts(target, questions=None, tasks=TASKS,
                                      per_task=args.per_task)
    tasks = list(dict.fromkeys(e["task"] for e in evals))
    trees = trees or [drafter.tree_for(args.temperature)]  # what generate drafts
    rows = paired_runs(target, drafter, trees, [e["ids"] for e in evals],
                       max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_p=args.top_p, seed=args.seed, vanilla=True,
                       tasks=[e["task"] for e in evals],
                       desc=f"T={args.temperature} top-p={args.top_p}")

    results = []
    for tree, tree_rows in zip(trees, rows, strict=True):
        res = {"tree": tree.to_json() if tree else None,
               "per_task": {t: pooled([r for r in tree_rows if r["task"] == t]) for t in tasks},
               "overall": pooled(tree_rows), "per_prompt": tree_rows}
        if results:  # each later tree against the first, on the same prompts
            res["vs_first"] = relative_speed(tree_rows, rows[0])
            if args.length_split:
                res["vs_first_by_length"] = by_length(tree_rows, rows[0], args.length_split)
        results.append(res)
        vs = ({"all": res["vs_first"], **res.get("vs_first_by_length", {})}
              if "vs_first" in res else {})
        print(f"tree {res['tree']}" + "".join(
            f"\n  speed vs the first, {k} prompt tokens: {v['ratio']:.3f} "
            f"[{v['ci95'][0]:.3f}, {v['ci95'][1]:.3f}]" for k, v in vs.items()))
        for name, p in [*res["per_task"].items(), ("overall", res["overall"])]:
            print(f"  {name:15s} MAL {p['mal']:.2f}  vanilla {p['vanilla_tokens_per_s']:.1f}  "
                  f"spec {p['spec_tokens_per_s']:.1f} tok/s  {p['speedup']:.2f}x "
                  f"[{p['speedup_ci95'][0]:.2f}, {p['speedup_ci95'][1]:.2f}]  "
                  f"chained {p['chained_fraction']:.2f}")
    head = {"model": args.model or "SmolLM2-135M-Instruct", "temperature": args.temperature,
            "top_p": args.top_p,
            "max_new_tokens": args.max_new_tokens,
            "prompts": "calibration" if args.calibration else "spec-bench"}
    if args.calibration:
        head |= {"skip": args.skip, "long_share": args.long_share,
                 "max_prompt_tokens": args.max_prompt_tokens,
                 "prompt_tokens": [len(e["ids"]) for e in evals]}
    # One tree keeps the flat layout earlier results used; several go under "trees".
    result = {**head, **results[0]} if len(results) == 1 else {**head, "trees": results}
    if args.out:
        write_json(Path(args.out), result)


if __name__ == "__main__":
    main()
