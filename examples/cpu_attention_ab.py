"""The CPU cache-attention kernel on and off, interleaved in one process: vanilla and the
shipped trees (greedy: static ``0 1 2``; temperature 1: dyspec-threshold d1 n3; both with
lookup 8 m2 and ``fr:8192``) on a short calibration prompt and on an ~800-token one (three
calibration prompts' ids joined, the length of Spec-Bench's summarization and rag prompts),
128 new tokens. ``SPECJAX_CPU_ATTENTION`` is read at trace time, so every switch clears
jax's caches and re-warms (the persistent compile cache makes that cheap); each round times
one call per configuration after a warm-up. Writes JSON: every rate, and the medians.

    python examples/cpu_attention_ab.py --rounds 3 --out results/cpu_attention_ab.json
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
from specjax.tree import TreeSpec

LOOKUP = dict(lookup=8, lookup_ngram=3, lookup_min=2)


def shipped_tree(temperature: float) -> TreeSpec:
    if temperature == 0:
        return TreeSpec("static", paths=((0,), (1,), (2,)), **LOOKUP)
    return TreeSpec("dyspec-threshold", depth=1, total_tokens=3, threshold=0.001, **LOOKUP)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    target = specjax.load(resolve_model(None, progress=False))
    drafter = specjax.load_drafter(shipped_drafter_for(target.cfg), target)
    prompts, _ = calibration_prompts(target, num=24)
    prompts_by_name = {"short": next(p for p in prompts if len(p) < 400),
                       "long": sum(sorted(prompts, key=len)[-3:], [])[:800]}
    rates: dict[str, list[float]] = {}
    for rnd in range(args.rounds):
        for setting in ("off", "on"):
            os.environ["SPECJAX_CPU_ATTENTION"] = setting
            jax.clear_caches()
            for temp in map(float, args.temperatures.split(",")):
                for pname, prompt in prompts_by_name.items():
                    for mode in ("vanilla", "spec"):
                        kw = dict(max_new_tokens=128, stop_on_eos=False, temperature=temp,
                                  seed=0)
                        if mode == "spec":
                            kw |= dict(drafter=drafter, tree=shipped_tree(temp),
                                       vocab="fr:8192")
                        specjax.generate(target, [prompt], **kw)  # compile or re-warm
                        r = specjax.generate(target, [prompt], **kw)
                        key = f"T={temp:g}/{pname}/{mode}"
                        rates.setdefault(f"{key}/{setting}", []).append(
                            r.stats["decode_tokens_per_s"])
            print(f"round {rnd} {setting} done", flush=True)
    summary = {}
    for key in sorted({k.rsplit("/", 1)[0] for k in rates}):
        on, off = np.median(rates[f"{key}/on"]), np.median(rates[f"{key}/off"])
        summary[key] = dict(on=float(on), off=float(off), on_over_off=float(on / off))
        print(f"{key:22s} off {off:5.1f}  on {on:5.1f} tok/s  on/off {on / off:.3f}")
    for temp in map(float, args.temperatures.split(",")):
        for pname in prompts_by_name:
            key = f"T={temp:g}/{pname}"
            for setting in ("off", "on"):
                ratio = summary[f"{key}/spec"][setting] / summary[f"{key}/vanilla"][setting]
                summary[f"{key}/spec_over_vanilla/{setting}"] = float(ratio)
                print(f"{key:14s} spec/vanilla with the kernel {setting}: {ratio:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(rates=rates, summary=summary, lengths={
                k: len(v) for k, v in prompts_by_name.items()}), f, indent=1)


if __name__ == "__main__":
    main()
