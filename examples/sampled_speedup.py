"""Speculative against vanilla decoding when *sampling*, on the Spec-Bench prompts.

``specjax bench spec`` times greedy decoding, where the output must equal vanilla's. When
sampling, outputs differ run to run (only their distribution is the target's, which the
chi-square tests check), so this script compares speed alone: for each prompt, vanilla and
speculative decoding (the drafter's shipped default tree and head unless given) draw
``--max-new-tokens`` tokens at ``--temperature`` without stopping at EOS, and the decode
rates (compile excluded, ``decode_tokens_per_s``) are pooled over the prompts, in one run.

    python examples/sampled_speedup.py --temperature 1.0 --out results/sampled_speedup.json

``--calibration N`` runs about N calibration prompts instead (ShareGPT's calibration range,
never Spec-Bench: :func:`specjax.bench.questions.calibration_prompts`, whose prompt mix
rounds each kind's share), for choosing a tree before it is evaluated once on Spec-Bench.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

import specjax
from specjax.bench.questions import TASKS, calibration_prompts, spec_bench_prompts
from specjax.defaults import resolve_model, shipped_drafter_for
from specjax.tree import TreeSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--per-task", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tree-json", default=None, metavar="JSON",
                    help="a TreeSpec as JSON, e.g. '{\"kind\": \"eagle2\", \"depth\": 1, "
                         "\"top_k\": 1, \"total_tokens\": 1}' (default: the drafter's "
                         "shipped tree)")
    ap.add_argument("--calibration", type=int, default=0, metavar="N",
                    help="about N calibration prompts instead of Spec-Bench's (default 0: "
                         "Spec-Bench)")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args()
    target = specjax.load(resolve_model(None, progress=False))
    drafter = specjax.load_drafter(shipped_drafter_for(target.cfg), target)
    if args.calibration:
        ids, _ = calibration_prompts(target, num=args.calibration)
        evals = [{"task": "calibration", "ids": p} for p in ids]
    else:
        evals, _ = spec_bench_prompts(target, questions=None, tasks=TASKS,
                                      per_task=args.per_task)
    tasks = list(dict.fromkeys(e["task"] for e in evals))
    tree = (TreeSpec.from_json(json.loads(args.tree_json)) if args.tree_json
            else drafter.default_tree)  # None: generate's own default (TreeSpec())
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
              stop_on_eos=False)
    rows = []
    for i, e in enumerate(tqdm(evals, desc=f"T={args.temperature}")):
        van = specjax.generate(target, [e["ids"]], seed=args.seed + i, **kw)
        spec = specjax.generate(target, [e["ids"]], drafter=drafter, tree=tree,
                                seed=args.seed + i, **kw)
        # The first new token is the prefill's; decode time leaves compiles out.
        n = spec.stats["new_tokens"] - 1
        rows.append({"task": e["task"], "tokens": n,
                     "vanilla_decode_s": n / van.stats["decode_tokens_per_s"],
                     "spec_decode_s": n / spec.stats["decode_tokens_per_s"],
                     "mal": spec.stats["mean_accepted_length"],
                     "chained_fraction": spec.stats["chained_fraction"]})

    def pooled(rs: list[dict]) -> dict:
        tok = sum(r["tokens"] for r in rs)
        van, spec = sum(r["vanilla_decode_s"] for r in rs), sum(r["spec_decode_s"] for r in rs)
        return {"prompts": len(rs), "vanilla_tokens_per_s": tok / van,
                "spec_tokens_per_s": tok / spec, "speedup": van / spec,
                "mal": sum(r["mal"] for r in rs) / len(rs)}

    result = {"temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
              "tree": tree.to_json() if tree else None,
              "prompts": "calibration" if args.calibration else "spec-bench",
              "per_task": {t: pooled([r for r in rows if r["task"] == t]) for t in tasks},
              "overall": pooled(rows), "per_prompt": rows}
    for name, p in [*result["per_task"].items(), ("overall", result["overall"])]:
        print(f"{name:15s} MAL {p['mal']:.2f}  vanilla {p['vanilla_tokens_per_s']:.1f}  "
              f"spec {p['spec_tokens_per_s']:.1f} tok/s  {p['speedup']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
