"""What one sampled or greedy token costs on this machine: ``jax.random.categorical``
(Gumbel-max), the same token through ``first_argmax`` (specjax's draw until the
sixty-seventh session), and ``specjax.sampling.categorical`` (the same law, inverse CDF
through :func:`specjax.sampling.draw`); ``jnp.argmax`` against ``first_argmax`` (the same
index); a draw filtered by top-k 50 or top-p 0.9, its threshold from a sort (``lax.top_k``,
``jnp.sort``: specjax's filters until the eighty-second session) and from specjax's
(:func:`specjax.sampling.kth_largest`, ``lax.top_k`` read whole; for top-p the bisection
over the row alone, as in the eighty-second session, and
:func:`specjax.sampling.nucleus_threshold`, which first looks among the 256 largest logits
and bisects only where the nucleus is wider); over a vocabulary of V ids.

The argmaxes and the two Gumbel-max draws are checked equal, the two ways of each filter
checked to keep the same ids, and the inverse-CDF draw checked to be an id, first; each
function is then timed two ways:

* ``called``: jitted and called alone, ``--runs`` times (median and best, ms;
  :func:`specjax.bench.timing.time_calls`). This includes a dispatch of tens of
  microseconds, which the decode loops never pay: they run inside one compiled
  ``lax.while_loop``.
* ``in_loop``: ``--inner`` applications inside one jitted ``lax.fori_loop``, each on logits
  nudged at one id so that XLA cannot hoist it, per application (best of ``--loop-runs``
  loops, ms). This is what a step of the loop pays.

Logits are ``--scale`` times standard normals. A model's are sharper than the default 3
(SmolLM2's nucleus at top-p 0.9: 9 ids at the median; 1,491 here over 49,152 ids), which
times nucleus_threshold's fallback. ``--scale 5`` over 49,152 ids (5) and ``--scale 6`` over
Gemma 3's 262,144 (17) time its top-k path; at 5, two of six 262k rows still fall back.

Rows: 1 is vanilla decoding's token and speculative decoding's bonus token; 4 and 14 are
the shipped greedy tree's verify rows without and with its lookup chain (greedy
verification takes the argmax of every row); 6 the rows of SmolLM2's tree for sampling at
temperature 1 (sampled verification filters every row's logits).

    python examples/sampling_cost.py --out results/sampling_cost.json
    python examples/sampling_cost.py --vocab 262144 --rows 1,6 --scale 6
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import Array

from specjax.bench.common import write_json
from specjax.bench.timing import time_calls
from specjax.sampling import (
    _bisect_nucleus,
    _nucleus_mass,
    categorical,
    first_argmax,
    kth_largest,
    nucleus_threshold,
)

TOP_K, TOP_P = 50, 0.9


def sorted_top_k(x: Array) -> Array:
    """The k-th largest logit [n, 1]: ``lax.top_k``'s last value, which XLA:CPU computes
    by sorting the row."""
    return jax.lax.top_k(x, TOP_K)[0][..., -1:]


def sorted_top_p(x: Array) -> Array:
    """The smallest logit top-p keeps [n, 1] through a sort of the row: the last id whose
    mass before it in the sorted order is < top_p."""
    desc = -jnp.sort(-x, axis=-1)
    p = jax.nn.softmax(desc, axis=-1)
    return jnp.min(jnp.where(jnp.cumsum(p, axis=-1) - p < TOP_P, desc, jnp.inf), axis=-1,
                   keepdims=True)


# Each filter's thresholds [n, 1]: the sort-based way first, then specjax's, all of which
# must keep the same ids.
THRESHOLDS = {"top-k 50": {"lax.top_k": sorted_top_k,
                           "kth_largest": lambda x: kth_largest(x, TOP_K)},
              "top-p 0.9": {"sort": sorted_top_p,
                            "bisection": lambda x: _bisect_nucleus(x, *_nucleus_mass(x, TOP_P)),
                            "nucleus_threshold": lambda x: nucleus_threshold(x, TOP_P)}}


def filtered(threshold: Callable[[Array], Array]) -> Callable[[Array, Array], Array]:
    """A draw from the logits at or above ``threshold(logits)`` [n, 1]."""
    return lambda k, x: categorical(k, jnp.where(x < threshold(x), -jnp.inf, x))


def in_loop_ms(fn: Callable[[Array, Array], Array], key: Array, logits: Array, inner: int,
               runs: int) -> float:
    """Milliseconds per application of ``fn(key, logits)`` ([n, V] -> [n] int32) inside a
    jitted ``fori_loop`` of ``inner`` applications, best of ``runs`` loops. Each application
    sees logits nudged at one id and its own key, and the results are summed, so none is
    hoisted or dropped."""

    @jax.jit
    def loop(key: Array, logits: Array) -> Array:
        def body(i, carry):
            acc, x = carry
            x = x.at[:, i % 7].add(1e-3)
            return acc + fn(jax.random.fold_in(key, i), x), x

        init = (jnp.zeros(logits.shape[:-1], jnp.int32), logits)
        return jax.lax.fori_loop(0, inner, body, init)[0]

    jax.block_until_ready(loop(key, logits))
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(key, logits))
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best / inner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=49_152, help="V (default SmolLM2's)")
    ap.add_argument("--rows", default="1,4,14")
    ap.add_argument("--scale", type=float, default=3.0, help="logits' standard deviation")
    ap.add_argument("--runs", type=int, default=200, help="timed calls (called)")
    ap.add_argument("--inner", type=int, default=100, help="applications a loop (in_loop)")
    ap.add_argument("--loop-runs", type=int, default=15, help="timed loops (in_loop)")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args()
    fns = {"jax.random.categorical": lambda k, x: jax.random.categorical(k, x, -1),
           # specjax's draw until the sixty-seventh session: jax's token, two reductions.
           "gumbel + first_argmax": lambda k, x: first_argmax(
               x + jax.random.gumbel(k, x.shape, x.dtype)),
           "specjax categorical": categorical,
           "jnp.argmax": lambda k, x: jnp.argmax(x, -1).astype(jnp.int32),
           "first_argmax": lambda k, x: first_argmax(x),
           **{f"{kind} by {way}": filtered(fn) for kind, ways in THRESHOLDS.items()
              for way, fn in ways.items()}}
    thresholds = [[jax.jit(fn) for fn in ways.values()] for ways in THRESHOLDS.values()]
    jitted = {name: jax.jit(fn) for name, fn in fns.items()}
    rows = []
    for n in (int(r) for r in args.rows.split(",")):
        key, sub = jax.random.split(jax.random.PRNGKey(n))
        logits = args.scale * jax.random.normal(key, (n, args.vocab))
        assert (jitted["gumbel + first_argmax"](sub, logits)
                == jitted["jax.random.categorical"](sub, logits)).all()
        tok = jitted["specjax categorical"](sub, logits)
        assert tok.shape == (n,) and bool((tok >= 0).all() & (tok < args.vocab).all())
        assert (jitted["first_argmax"](sub, logits) == jitted["jnp.argmax"](sub, logits)).all()
        for old, *new in thresholds:
            for fn in new:  # the same ids kept (random logits: no ties)
                assert ((logits >= old(logits)) == (logits >= fn(logits))).all()
        row = {"rows": n}
        for name, fn in fns.items():
            call = partial(jitted[name], sub, logits)
            row[name] = {"called": time_calls(call, args.runs),
                         "in_loop_ms": in_loop_ms(fn, sub, logits, args.inner, args.loop_runs)}
        rows.append(row)
        print(f"rows {n:3d}: " + "  ".join(
            f"{k} {v['called']['median_ms']:.3f} / {v['in_loop_ms']:.3f}"
            for k, v in row.items() if k != "rows") + "  (ms: called, median / in a loop)")
    if args.out:
        write_json(Path(args.out), {"vocab": args.vocab, "scale": args.scale,
                                    "runs": args.runs, "inner": args.inner,
                                    "loop_runs": args.loop_runs,
                                    "backend": jax.default_backend(), "rows": rows})


if __name__ == "__main__":
    main()
