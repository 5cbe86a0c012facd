"""Compiled vs eager vanilla decoding on the default model (or --model), as JSON + a plot.

The compiled mode runs every decode step inside one ``lax.while_loop``; the
eager mode calls the same jitted step from Python once per token, paying a
dispatch and a host sync each time. The ratio is the loop's own worth.

    python examples/compiled_vs_eager.py --max-new-tokens 64 --out results/compiled_vs_eager.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

import specjax  # noqa: E402
from specjax.defaults import resolve_model  # noqa: E402

PROMPT = "Write a short paragraph about the history of the printing press."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="results/compiled_vs_eager.json")
    args = ap.parse_args()

    target = specjax.load(resolve_model(args.model))
    runs: dict[str, list[float]] = {"compiled": [], "eager": []}
    tokens = {}
    for mode in tqdm(runs, desc="modes"):
        # The first call compiles; it is not timed.
        specjax.generate(target, PROMPT, max_new_tokens=args.max_new_tokens, mode=mode,
                         stop_on_eos=False)
        for _ in range(args.repeats):
            res = specjax.generate(target, PROMPT, max_new_tokens=args.max_new_tokens, mode=mode,
                                   stop_on_eos=False)
            runs[mode].append(res.stats["decode_tokens_per_s"])
            tokens[mode] = res.tokens[0]
    med = {m: statistics.median(v) for m, v in runs.items()}
    result = {"max_new_tokens": args.max_new_tokens, "decode_tokens_per_s": runs,
              "median": med, "compiled_over_eager": med["compiled"] / med["eager"],
              "same_tokens": tokens["compiled"] == tokens["eager"]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.bar(list(med), list(med.values()), color=["tab:blue", "tab:gray"])
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"compiled / eager = {result['compiled_over_eager']:.2f}x")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(json.dumps(result["median"]), f"ratio {result['compiled_over_eager']:.2f}",
          f"same tokens: {result['same_tokens']}")


if __name__ == "__main__":
    main()
