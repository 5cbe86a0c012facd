"""The CPU cache-attention kernel on and off (or any two ``SPECJAX_CPU_ATTENTION`` settings,
e.g. its score layouts ``dots`` and ``lanes``), interleaved in one process: vanilla and the
shipped drafter's measured trees and head (its folder's default_tree.json: one for greedy,
one for sampling) on a short calibration prompt and on an ~800-token one (three
calibration prompts' ids joined, the length of Spec-Bench's summarization and rag prompts),
128 new tokens. ``SPECJAX_CPU_ATTENTION`` is read at trace time, so every switch clears
jax's caches and re-warms (the persistent compile cache makes that cheap); each round times
one call per configuration and setting after a warm-up, the two settings back to back and
in alternating order. Writes JSON: every rate, and the medians.

    python examples/cpu_attention_ab.py --rounds 3 --out results/cpu_attention_ab.json
    python examples/cpu_attention_ab.py --settings dots,auto --out results/scores_ab.json
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import numpy as np

import specjax
from specjax.bench.questions import calibration_prompts
from specjax.defaults import resolve_model, shipped_drafter_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--settings", default="off,on",
                    help="two SPECJAX_CPU_ATTENTION values, A,B; ratios are B over A")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    settings = args.settings.split(",")
    if len(settings) != 2:
        ap.error(f"--settings takes two values, A,B; got {args.settings!r}")
    first, second = settings
    target = specjax.load(resolve_model(None, progress=False))
    drafter = specjax.load_drafter(shipped_drafter_for(target.cfg), target)
    prompts, _ = calibration_prompts(target, num=24)
    prompt_by_name = {"short": next(p for p in prompts if len(p) < 400),
                      "long": sum(sorted(prompts, key=len)[-3:], [])[:800]}
    temperatures = [float(t) for t in args.temperatures.split(",")]
    rates: dict[str, list[float]] = {}
    configs = [(temp, pname, mode) for temp in temperatures for pname in prompt_by_name
               for mode in ("vanilla", "spec")]
    for rnd in range(args.rounds):
        # The two settings run back to back on each configuration, first one then the other
        # in turn, so that a slow spell of a shared machine lands on both alike.
        for temp, pname, mode in configs:
            for setting in settings if rnd % 2 == 0 else settings[::-1]:
                os.environ["SPECJAX_CPU_ATTENTION"] = setting
                jax.clear_caches()
                kw = dict(max_new_tokens=128, stop_on_eos=False, temperature=temp, seed=0)
                if mode == "spec":  # the drafter folder's measured defaults
                    kw |= dict(drafter=drafter, tree=drafter.tree_for(temp),
                               vocab=drafter.default_vocab)
                specjax.generate(target, [prompt_by_name[pname]], **kw)  # compile or re-warm
                r = specjax.generate(target, [prompt_by_name[pname]], **kw)
                key = f"T={temp:g}/{pname}/{mode}"
                rates.setdefault(f"{key}/{setting}", []).append(r.stats["decode_tokens_per_s"])
        print(f"round {rnd} done", flush=True)
    summary = {}
    for key in sorted({k.rsplit("/", 1)[0] for k in rates}):
        a, b = np.median(rates[f"{key}/{first}"]), np.median(rates[f"{key}/{second}"])
        summary[key] = {first: float(a), second: float(b), f"{second}_over_{first}": float(b / a)}
        print(f"{key:22s} {first} {a:5.1f}  {second} {b:5.1f} tok/s  "
              f"{second}/{first} {b / a:.3f}")
    for temp in temperatures:
        for pname in prompt_by_name:
            key = f"T={temp:g}/{pname}"
            for setting in settings:
                ratio = summary[f"{key}/spec"][setting] / summary[f"{key}/vanilla"][setting]
                summary[f"{key}/spec_over_vanilla/{setting}"] = float(ratio)
                print(f"{key:14s} spec/vanilla with {setting}: {ratio:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(rates=rates, summary=summary, lengths={
                k: len(v) for k, v in prompt_by_name.items()}), f, indent=1)


if __name__ == "__main__":
    main()
