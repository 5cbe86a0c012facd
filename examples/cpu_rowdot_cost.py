"""The weight products of one SmolLM2-135M target forward at M = 1..16 rows: XLA's dot on the
[in, out] layout the model stores, XLA's dot on [out, in], and the CPU rowdot kernel on
[out, in]. Writes JSON (and a plot with --plot); best of --runs, the three timed in turn.

    python examples/cpu_rowdot_cost.py --out results/cpu_rowdot_cost.json --plot

The shapes are one forward's: 30 layers of fused Q/K/V (576 -> 960), O (576 -> 576), fused
gate/up (576 -> 3072) and down (1536 -> 576), then the tied LM head (576 -> 49,152); 538 MB
of float32 weights, so a product that streams them once is bounded by memory bandwidth.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels.cpu_rowdot import available, rowdot

LAYER = [(576, 960), (576, 576), (576, 3072), (1536, 576)]


def _best(f, *args, runs: int) -> float:
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return min(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--out", type=Path, default=Path("results/cpu_rowdot_cost.json"))
    ap.add_argument("--plot", action="store_true")
    args = ap.parse_args()
    ok, why = available()
    if not ok:
        raise SystemExit(f"the rowdot kernel is not available here: {why}")
    rng = np.random.default_rng(0)
    shapes = LAYER * args.layers + [(576, 49152)]
    w_io = [jnp.asarray(rng.standard_normal(s, np.float32) * 0.02) for s in shapes]
    w_oi = [jnp.asarray(np.asarray(w).T.copy()) for w in w_io]
    mb = sum(w.size for w in w_io) * 4 / 1e6
    # Each product gets an input of its own width (576, or 1536 for down), picked at trace
    # time from the weight's shape.
    paths = {
        "xla [in, out]": (jax.jit(lambda xs, ws: [xs[w.shape[0]] @ w for w in ws]), w_io),
        "xla [out, in]": (jax.jit(lambda xs, ws: [xs[w.shape[1]] @ w.T for w in ws]), w_oi),
        "rowdot [out, in]": (jax.jit(lambda xs, ws: [rowdot(xs[w.shape[1]], w) for w in ws]),
                             w_oi),
    }
    rows = [int(r) for r in args.rows.split(",")]
    res: dict[str, dict[int, float]] = {k: {} for k in paths}
    for m in rows:
        xs = {k: jnp.asarray(rng.standard_normal((m, k), np.float32)) for k in (576, 1536)}
        for name, (f, ws) in paths.items():
            res[name][m] = _best(f, xs, ws, runs=args.runs)
        line = "  ".join(f"{k} {v[m]:7.2f} ms ({v[m] / v[rows[0]]:.2f}x)" for k, v in res.items())
        print(f"M={m:2d}  {line}", flush=True)
    out = {"weights_mb": mb, "rows": rows, "ms": res,
           "gb_per_s_at_m1": {k: mb / v[rows[0]] for k, v in res.items()},
           "devices": str(jax.devices()), "runs": args.runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    if args.plot:
        from specjax.bench.common import pyplot

        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, v in res.items():
            ax.plot(rows, [v[m] for m in rows], marker="o", label=name)
        ax.set_xlabel("rows M (tree nodes verified)")
        ax.set_ylabel(f"ms for one forward's products ({mb:.0f} MB)")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
