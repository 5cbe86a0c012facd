"""What one sampled token costs on this machine: ``jax.random.categorical`` against
``specjax.sampling.categorical`` (the same token, through two plain reductions), and
``jnp.argmax`` against ``first_argmax`` on plain logits, over a vocabulary of V ids.

Each function is jitted and timed alone, in turn, ``--runs`` times (median and best, ms;
:func:`specjax.bench.timing.time_calls`); the draws are checked equal first. Rows: 1 is
vanilla decoding's draw and speculative decoding's bonus token; more rows are a batch.

    python examples/sampling_cost.py --out results/sampling_cost.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax.bench.common import write_json
from specjax.bench.timing import time_calls
from specjax.sampling import categorical, first_argmax


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=49_152, help="V (default SmolLM2's)")
    ap.add_argument("--rows", default="1,2,10")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args()
    fns = {"jax.random.categorical": jax.jit(lambda k, x: jax.random.categorical(k, x, -1)),
           "specjax categorical": jax.jit(categorical),
           "jnp.argmax": jax.jit(lambda x: jnp.argmax(x, -1)),
           "first_argmax": jax.jit(first_argmax)}
    rows = []
    for n in (int(r) for r in args.rows.split(",")):
        key, sub = jax.random.split(jax.random.PRNGKey(n))
        logits = 3.0 * jax.random.normal(key, (n, args.vocab))
        assert (fns["specjax categorical"](sub, logits)
                == fns["jax.random.categorical"](sub, logits)).all()
        assert (fns["first_argmax"](logits) == fns["jnp.argmax"](logits)).all()
        row = {"rows": n}
        for name, fn in fns.items():
            call = (sub, logits) if "categorical" in name else (logits,)
            row[name] = time_calls(lambda fn=fn, call=call: fn(*call), args.runs)
        rows.append(row)
        print(f"rows {n:3d}: " + "  ".join(f"{k} {v['median_ms']:.3f}" for k, v in row.items()
                                           if k != "rows") + "  (median ms)")
    if args.out:
        write_json(Path(args.out), {"vocab": args.vocab, "runs": args.runs,
                                    "backend": jax.default_backend(), "rows": rows})


if __name__ == "__main__":
    main()
