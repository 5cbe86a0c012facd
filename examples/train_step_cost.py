"""Drafter training step cost: the full LM head on every row against a shortlist on scored rows.

Times the real jitted train step (``specjax.train.drafter``) on the same batches of a
hidden-state cache for three settings, in one process, and prints the ratios::

    python examples/train_step_cost.py CACHE_DIR [--shortlist fr:8192] [--batches 6]

CACHE_DIR is a cache written by ``specjax train drafter --cache-only``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import specjax
from specjax.defaults import ensure_default_target
from specjax.train.cli import train_shortlist
from specjax.train.data import load_split, plan_batches, rows_for
from specjax.train.drafter import (
    TrainConfig,
    _split_buckets,
    compiled_steps,
    init_drafter,
    score_cap,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cache", type=Path)
    p.add_argument("--shortlist", default="fr:8192")
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--tokens", type=int, default=1024, help="padded tokens per step")
    args = p.parse_args()

    target = specjax.load(ensure_default_target())
    split = load_split(args.cache, "train")
    plan = plan_batches(split.lengths, _split_buckets(split), args.tokens,
                        np.random.default_rng(0))
    t = Counter(t for t, _ in plan).most_common(1)[0][0]  # the most common bucket
    batches = [split.batch(t, rows, rows_for(t, args.tokens))
               for tt, rows in plan if tt == t][: args.batches]
    short = jnp.take(target.params.head, jnp.asarray(train_shortlist(args.shortlist, target)),
                     axis=0)
    best = {}
    for name, head, packed, ttt in [("full vocabulary, every row", target.params.head, False, 1),
                                    (f"{args.shortlist}, scored rows", short, True, 1),
                                    (f"{args.shortlist}, scored rows, TTT 2", short, True, 2)]:
        tc = TrainConfig(steps=100, token_budget=args.tokens, ttt_steps=ttt)
        graphdef, params = nnx.split(init_drafter(target.cfg, target.params, tc), nnx.Param)
        params = jax.tree.map(lambda a: jnp.array(a, copy=True), params)
        tx, step, _ = compiled_steps(graphdef, tc, 100)
        opt = tx.init(params)
        cap = max(score_cap(int(b["loss_mask"].sum()), b["loss_mask"].size)
                  for b in batches) if packed else None
        times = []
        for i, b in enumerate([batches[0]] + batches * 2):  # the first call compiles
            t0 = time.perf_counter()
            params, opt, loss, _ = step(params, opt, target.params.embed, head,
                                        jnp.asarray(b["tokens"]), jnp.asarray(b["hidden"]),
                                        jnp.asarray(b["loss_mask"]), jax.random.PRNGKey(i),
                                        cap=cap)
            loss.block_until_ready()
            times.append(time.perf_counter() - t0)
        best[name] = min(times[1:])
    base = best["full vocabulary, every row"]
    print(json.dumps({"bucket": t, "scored_fraction": float(np.mean(
        [b["loss_mask"].mean() for b in batches])), "steps": {
        k: {"best_s": round(v, 3), "x_faster": round(base / v, 2)} for k, v in best.items()}},
        indent=1))


if __name__ == "__main__":
    main()
