"""Does ``bench spec``'s estimate order trees as its paired A/B does, and on which
calibration? A finished greedy ``bench spec`` run (its JSON) holds each tree's estimate,
the latency curve and draft times it came from, and, with ``--ab-trees``, the A/B's
end-to-end speeds. This recounts every tree's calibration MAL (and the share of steps that
grafted its lookup chain) over ``--new-tokens`` new tokens on ``--prompts`` calibration
prompts (ShareGPT's calibration range, never Spec-Bench; ``--long-share`` of them with a
450-1,000-token text, as the A/B's prompts), re-prices it with the run's own curve and
draft times (:func:`specjax.bench.spec_select.step_estimate`), and prints the estimate's
order of the A/B's trees before and after beside the A/B's.

Several runs of one model and drafter share the counts (counted here, once, and cached in
``--out``; greedy MAL moves little between machines, so runs from another host re-price
with them too):

    python examples/calibration_budget.py results/bench_spec_s86_ab3.json \\
        results/bench_spec_s86_avx2_choice.json --new-tokens 128 --out results/calib_128.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tqdm import tqdm


def reestimate(result: dict[str, Any], counts: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each tree of ``result``'s grid that ``counts`` holds (by label: ``{"mal",
    "chained"}``), estimated as the run estimated it (its curve and draft time) but with
    that MAL and chained fraction: ``{"label", "old", "new"}`` tokens/s, in grid order."""
    from specjax.bench.spec_select import step_estimate
    from specjax.speculative import TreeSpec

    sel = result["tree_selection"]
    return [{"label": g["label"], "old": g["est_tokens_per_s"],
             "new": step_estimate(sel["latency"], TreeSpec.from_json(g["tree"]),
                                  mal=counts[g["label"]]["mal"],
                                  chained=counts[g["label"]]["chained"],
                                  draft_ms=g["draft_ms"])["est_tokens_per_s"]}
            for g in sel["grid"] if g["label"] in counts]


def ab_order(result: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, list]:
    """The A/B's trees ranked three ways: by the A/B's speed, by the run's estimate and by
    the new one; each ``[label, speed relative to that ranking's first]``."""
    ab = {r["label"]: r["vs_fastest"]["ratio"] for r in result["tree_selection"]["ab"]["results"]}
    est = {r["label"]: r for r in rows if r["label"] in ab}

    def rank(score: dict[str, float]) -> list:
        top = max(score.values())
        return [[k, round(v / top, 3)] for k, v in sorted(score.items(), key=lambda kv: -kv[1])]

    return {"ab": rank(ab), "old": rank({k: r["old"] for k, r in est.items()}),
            "new": rank({k: r["new"] for k, r in est.items()})}


def count(result: dict[str, Any], labels: set[str], *, prompts: int, new_tokens: int,
          long_share: float, cache: dict[str, dict[str, Any]]) -> None:
    """Add to ``cache`` the calibration MAL and chained fraction of each tree of
    ``result``'s grid in ``labels`` that it lacks (its model, drafter and head)."""
    import specjax
    from specjax.bench.phases import load_models
    from specjax.bench.questions import calibration_prompts
    from specjax.bench.spec_select import AB_MAX_PROMPT_TOKENS
    from specjax.speculative import TreeSpec
    from specjax.train.prompts import with_long_share
    from specjax.vocab import resolve_head

    todo = [g for g in result["tree_selection"]["grid"]
            if g["label"] in labels and g["label"] not in cache]
    if not todo:
        return
    cfg = result["config"]
    target, drafter, _ = load_models(cfg["model"], None, None, cfg["drafter"])
    head = resolve_head(cfg["vocab"], target, drafter)
    # Short prompts as bench spec's estimate takes them; with long ones, the A/B's limit.
    longest = {"max_prompt_tokens": AB_MAX_PROMPT_TOKENS} if long_share else {}
    ids, _ = calibration_prompts(target, num=prompts, weights=with_long_share(long_share),
                                 **longest)
    for g in tqdm(todo, unit="tree"):
        tree = TreeSpec.from_json(g["tree"])
        res = specjax.generate(target, ids, max_new_tokens=new_tokens, stop_on_eos=True,
                               drafter=drafter, tree=tree, vocab=head)
        cache[g["label"]] = {"mal": res.stats["mean_accepted_length"],
                             "chained": res.stats["chained_fraction"] if tree.lookup else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="greedy bench spec JSONs, one model")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--long-share", type=float, default=0.0)
    ap.add_argument("--ab-only", action="store_true", help="count only the A/B's trees")
    ap.add_argument("--out", type=Path, required=True, help="JSON: the counts and orders")
    a = ap.parse_args()
    saved = json.loads(a.out.read_text()) if a.out.is_file() else {}
    settings = {"new_tokens": a.new_tokens, "prompts": a.prompts, "long_share": a.long_share}
    cache = saved.get("counts", {}) if saved.get("settings") == settings else {}
    report = {}
    for path in a.results:
        result = json.loads(path.read_text())
        sel = result["tree_selection"]
        if not sel or "ab" not in sel:
            raise SystemExit(f"{path}: not a greedy bench spec run with --ab-trees (no A/B "
                             "to compare the estimate with)")
        labels = ({r["label"] for r in sel["ab"]["results"]} if a.ab_only
                  else {g["label"] for g in sel["grid"]})
        count(result, labels, prompts=a.prompts, new_tokens=a.new_tokens,
              long_share=a.long_share, cache=cache)
        a.out.write_text(json.dumps({"settings": settings, "counts": cache}, indent=1))
        rows = reestimate(result, cache)
        report[str(path)] = {"rows": rows, "order": ab_order(result, rows)}
        print(path)
        for k, v in report[str(path)]["order"].items():
            print(f"  {k:4s}", v)
        best = sorted(rows, key=lambda r: -r["new"])[:3]
        print("  the new estimate's best:", [[r["label"], round(r["new"], 1)] for r in best])
    a.out.write_text(json.dumps({"settings": settings, "counts": cache, "runs": report},
                                indent=1))


if __name__ == "__main__":
    main()
