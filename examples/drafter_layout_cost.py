"""The shipped drafter's forward (fc + its decoder layers) over M = 1..16 rows, with its layers
stored as checkpoints hold them ([in, out], XLA's dot) and as ``SpecRunner`` lays them out
beside an out-major target ([out, in], the CPU rowdot kernel; ``drafter.in_target_layout``).
The two layouts are timed in turn, call by call, over a cache of ``--context`` rows; best and
median of ``--runs`` calls. Writes JSON.

    python examples/drafter_layout_cost.py --out results/drafter_layout_cost.json

M = 1 is a chain's draft step; M = the tree's depth + 1 is the catch-up that re-reads the
accepted drafts after every verify (10 rows for the shipped chain d1 + lookup 8); M = top_k
is an EAGLE-2 level.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from specjax.defaults import resolve_model, shipped_drafter_for
from specjax.drafter import drafter_hidden, in_target_layout, init_drafter_cache
from specjax.model import is_out_major


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,9,16")
    ap.add_argument("--context", type=int, default=350, help="committed drafter cache rows")
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    target = specjax.load(resolve_model(None, progress=False))
    if not is_out_major(target.params):
        raise SystemExit("the target was not loaded out-major here (no rowdot kernel, or "
                         "SPECJAX_CPU_ROWDOT=off): both layouts would be the same")
    drafter = specjax.load_drafter(shipped_drafter_for(target.cfg), target)
    layouts = {"stored [in, out]": drafter.params,
               "target's [out, in]": in_target_layout(drafter.params, target.params)}
    embed = target.params.embed

    @jax.jit
    def forward(dp, tokens, feats, pos, cache):
        return drafter_hidden(dp, drafter.cfg, embed, tokens, feats, pos, cache)[0]

    rs = np.random.RandomState(0)
    rows = {}
    for m in (int(x) for x in args.rows.split(",")):
        cache = init_drafter_cache(drafter.cfg, 1, args.context + 64)
        cache = dataclasses.replace(cache, lengths=jnp.full((1,), args.context, jnp.int32))
        tokens = jnp.asarray(rs.randint(0, target.cfg.vocab_size, (1, m)), jnp.int32)
        feats = jnp.asarray(rs.randn(1, m, target.cfg.hidden_size), jnp.float32)
        pos = args.context + jnp.arange(m)[None]
        outs = {k: np.asarray(forward(dp, tokens, feats, pos, cache))
                for k, dp in layouts.items()}  # compiles each
        a, b = outs.values()
        assert np.allclose(a, b, atol=1e-4), "the layouts disagree"
        ms = {k: [] for k in layouts}
        for _ in range(args.runs):
            for k, dp in layouts.items():
                t = time.perf_counter()
                jax.block_until_ready(forward(dp, tokens, feats, pos, cache))
                ms[k].append(1e3 * (time.perf_counter() - t))
        rows[m] = {k: {"best_ms": min(v), "median_ms": float(np.median(v))}
                   for k, v in ms.items()}
        print(f"M={m:>2}: " + "   ".join(f"{k} best {v['best_ms']:.2f} median "
                                         f"{v['median_ms']:.2f} ms" for k, v in rows[m].items()))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(
            {"drafter": str(drafter.path), "layers": drafter.cfg.num_layers,
             "context": args.context, "runs": args.runs, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
