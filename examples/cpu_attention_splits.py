"""The CPU cache attention with its rows split across cores, against one range per query
group: thirty SmolLM2-135M layers' attention (9 query heads over 3 KV heads of 64) in one
jitted call, at several prefix lengths and new-token counts, batch 1.

At batch 1 a model with 3 KV heads gives the kernel 3 chunks of work for one query group, so
2 cores run 2 chunks' time and 16 cores leave 13 idle; the kernel then cuts each group's
rows into ranges and combines them (docs/kernels.md, "CPU cache attention"). Each
configuration is timed ``--rounds`` times in turn with ``splits=1`` (the fiftieth session's
kernel) and ``splits=0`` (the kernel's choice), ``--runs`` calls a round, so drift falls on
both alike; medians over all calls. ``--compare scores`` times the kernel's two score
layouts instead ("dots" and "lanes", splits chosen; sixty-second session). Writes JSON.

    python examples/cpu_attention_splits.py --out results/cpu_attention_splits.json
    python examples/cpu_attention_splits.py --compare scores --prefixes 60,300,800 \
        --rows 2,4,6,9,12,14 --out results/cpu_attention_scores.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels.cpu_attention import cache_attention

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64


def _layers(splits: int, scores: str = "auto"):
    # Each layer's query is the last one's output, as in a forward: XLA would otherwise run
    # independent calls side by side on its pool and balance the cores itself.
    @jax.jit
    def f(q, ks, vs, lengths, block_mask):
        outs = []
        for k, v in zip(ks, vs, strict=True):
            q = cache_attention(q, k, v, lengths, block_mask, HEAD_DIM ** -0.5, splits, scores)
            outs.append(q)
        return outs
    return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefixes", default="128,400,800,2000,4000")
    ap.add_argument("--rows", default="1,4,12")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--compare", choices=("splits", "scores"), default="splits")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    if args.compare == "splits":
        fns = {"one range": _layers(1), "split": _layers(0)}
    else:
        fns = {"dots": _layers(0, "dots"), "lanes": _layers(0, "lanes")}
    first, second = fns
    results = []
    for prefix in map(int, args.prefixes.split(",")):
        capacity = prefix + 64
        ks = [jnp.asarray(rng.standard_normal((1, capacity, KV_HEADS, HEAD_DIM), np.float32))
              for _ in range(2 * LAYERS)]
        ks, vs = ks[:LAYERS], ks[LAYERS:]
        for t in map(int, args.rows.split(",")):
            q = jnp.asarray(rng.standard_normal((1, t, HEADS, HEAD_DIM), np.float32))
            args_ = (q, ks, vs, jnp.array([prefix], jnp.int32),
                     jnp.tril(jnp.ones((t, t), bool))[None])
            want = fns[first](*args_)
            got = fns[second](*args_)
            diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(want, got, strict=True))
            times = {name: [] for name in fns}
            for _ in range(args.rounds):
                for name, f in fns.items():
                    for _ in range(args.runs):
                        t0 = time.perf_counter()
                        jax.block_until_ready(f(*args_))
                        times[name].append(1e3 * (time.perf_counter() - t0))
            row = {"prefix": prefix, "new_tokens": t, "max_abs_diff": diff,
                   **{f"{name} ms": float(np.median(v)) for name, v in times.items()}}
            row[f"{first} / {second}"] = row[f"{first} ms"] / row[f"{second} ms"]
            results.append(row)
            print(json.dumps(row), flush=True)
    out = {"compare": args.compare, "cores": os.cpu_count(), "layers": LAYERS,
           "rounds": args.rounds,
           "runs": args.runs, "results": results}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
