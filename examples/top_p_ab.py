"""Top-p's two thresholds in the compiled loop: the bisection over the whole row alone (the
eighty-second session's) against :func:`specjax.sampling.nucleus_threshold` (the nucleus
looked for among the 256 largest logits first, the bisection only where it is wider).

On N calibration prompts (ShareGPT's calibration range, never Spec-Bench) this decodes
each prompt with vanilla decoding and with speculative decoding (the drafter's shipped
defaults), at ``--temperature`` and ``--top-p``, in four blocks: bisection, top-k path,
top-k path, bisection (ABBA, so a linear drift of the machine's speed cancels). Each block
patches ``specjax.sampling.nucleus_threshold`` and clears jax's caches, so the loops are
traced again; the patched function counts its traces to prove it. Both thresholds keep the
same ids, so a prompt draws the same tokens in every block and only the time differs.

It also reports how wide the nucleus is on the model's own continuations (the vanilla
answers, one forward each; float64 sorted rule): the share of positions whose nucleus fits
in :data:`specjax.sampling.NUCLEUS_CANDIDATES` ids decides how often the top-k path serves.

    python examples/top_p_ab.py --model gemma3-270m \\
        --drafter specjax/assets/drafters/gemma3-270m --calibration 12 \\
        --out results/top_p_ab_gemma.json
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import specjax
import specjax.sampling as sampling
from specjax.bench.common import ratio_of_sums, write_json
from specjax.bench.questions import calibration_prompts
from specjax.defaults import resolve_model
from specjax.model import forward, init_cache

BLOCKS = ("bisection", "top-k path", "top-k path", "bisection")


def nucleus_widths(logits: np.ndarray, top_p: float) -> np.ndarray:
    """How many ids the sorted rule keeps in each row: logits [N, V] -> [N] int (float64;
    ties kept whole as in :func:`specjax.sampling.filter_logits`: the last id whose mass
    before it is < top_p carries the smallest kept logit, and every id at it is kept)."""
    z = -np.sort(-logits.astype(np.float64), axis=-1)
    p = np.exp(z - z[:, :1])
    p /= p.sum(-1, keepdims=True)
    last = ((np.cumsum(p, -1) - p) < top_p).sum(-1) - 1
    return (z >= z[np.arange(len(z)), last][:, None]).sum(-1)


def thresholds(traces: dict[str, int]) -> dict[str, Any]:
    """The two ways to top-p's threshold, each counting its traces in ``traces``."""
    real = sampling.nucleus_threshold

    def bisection(x, top_p, candidates=0):
        traces["bisection"] += 1
        return sampling._bisect_nucleus(x, *sampling._nucleus_mass(x, top_p))

    def top_k_path(x, top_p, candidates=sampling.NUCLEUS_CANDIDATES):
        traces["top-k path"] += 1
        return real(x, top_p, candidates)

    return {"bisection": bisection, "top-k path": top_k_path}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target (default SmolLM2)")
    ap.add_argument("--drafter", required=True, help="the drafter's folder")
    ap.add_argument("--calibration", type=int, default=12, help="calibration prompts")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args()
    target = specjax.load(resolve_model(args.model, progress=False))
    drafter = specjax.load_drafter(args.drafter, target)
    prompts, source = calibration_prompts(target, num=args.calibration)
    traces = {name: 0 for name in BLOCKS}
    ways = thresholds(traces)
    rates = {name: {"vanilla": [], "spec": []} for name in ways}
    answers: list[list[int]] = []
    original = sampling.nucleus_threshold
    try:
        for b, name in enumerate(BLOCKS):
            sampling.nucleus_threshold = ways[name]
            jax.clear_caches()
            before = traces[name]
            vanilla, spec = [], []
            for i, ids in enumerate(tqdm(prompts, desc=f"block {b + 1}: {name}")):
                kw = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                      "top_p": args.top_p, "seed": i, "stop_on_eos": False}
                if i == 0:  # compile both loops outside the timed calls
                    specjax.generate(target, [ids], **kw)
                    specjax.generate(target, [ids], drafter=drafter, **kw)
                v = specjax.generate(target, [ids], **kw)
                s = specjax.generate(target, [ids], drafter=drafter, **kw)
                vanilla.append(v.stats["decode_tokens_per_s"])
                spec.append(s.stats["decode_tokens_per_s"])
                if b == 0:
                    answers.append(ids + v.tokens[0])
            if traces[name] == before:
                raise RuntimeError(f"block {name}: the loop was not traced again")
            rates[name]["vanilla"].append(vanilla)
            rates[name]["spec"].append(spec)
    finally:
        sampling.nucleus_threshold = original
    result: dict[str, Any] = {"model": args.model, "drafter": args.drafter,
                              "temperature": args.temperature, "top_p": args.top_p,
                              "max_new_tokens": args.max_new_tokens, "prompts": source,
                              "blocks": list(BLOCKS), "rates": rates}
    for kind in ("vanilla", "spec"):  # tokens/s, top-k path over bisection, paired by prompt
        new = np.mean(rates["top-k path"][kind], 0)
        old = np.mean(rates["bisection"][kind], 0)
        result[f"{kind}_speed_ratio"] = ratio_of_sums(new, old)
        print(f"{kind}: top-k path {new.mean():.1f} tok/s, bisection {old.mean():.1f}, "
              f"ratio {result[f'{kind}_speed_ratio'][0]:.3f} {result[f'{kind}_speed_ratio'][1]}")
    for name in ways:
        ratio = ratio_of_sums(np.mean(rates[name]["spec"], 0), np.mean(rates[name]["vanilla"], 0))
        result[f"spec_over_vanilla_{name}"] = ratio
        print(f"speculative over vanilla with the {name}: {ratio[0]:.3f} {ratio[1]}")
    widths = []
    for seq, ids in zip(answers, prompts, strict=True):
        n = len(seq)
        logits, _ = forward(target.params, target.cfg, jnp.asarray([seq]),
                            jnp.arange(n)[None], init_cache(target.cfg, 1, n))
        scaled = np.asarray(logits[0, len(ids) - 1:-1], np.float64) / args.temperature
        widths.append(nucleus_widths(scaled, args.top_p))
    w = np.concatenate(widths)
    result["nucleus_widths"] = {"positions": len(w), "median": float(np.median(w)),
                                "p90": float(np.percentile(w, 90)),
                                "share_within_candidates":
                                    float((w <= sampling.NUCLEUS_CANDIDATES).mean()),
                                "share_within_64": float((w <= 64).mean()),
                                "share_within_1024": float((w <= 1024).mean())}
    print("nucleus widths:", result["nucleus_widths"])
    if args.out:
        write_json(Path(args.out), result)


if __name__ == "__main__":
    main()
