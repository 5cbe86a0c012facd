"""What the CPU cache-attention kernel (``kernels/cpu_attention.cc``) costs a SmolLM2-135M
forward (30 layers, 9 query / 3 KV heads of 64) at each committed context length and each
number of new rows: a verify step's rows each attend the whole prefix, so at a long
context the tree's rows, not the weights, decide how much a step's attention grows. Per
(context, rows): the median of ``--runs`` calls of one layer's kernel (compile excluded),
times 30, and the K/V bytes it read per second (a rate far below the machine's bandwidth
says the kernel is bound by its arithmetic, where a prefetch would not help).

    python examples/cpu_attention_cost.py --contexts 50,500,1000 --rows 1,4,12 \\
        --out results/cpu_attention_cost.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.bench.common import machine_info, write_json
from specjax.bench.timing import time_calls
from specjax.kernels.cpu_attention import SCORE_LAYOUTS, available, cache_attention

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
ROUNDS = 5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="50,500,1000")
    ap.add_argument("--rows", default="1,4,12")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--scores", default="auto",
                    help="comma-separated score layouts to time in turn (auto, dots, lanes)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    ok, why = available()
    if not ok:
        ap.exit(1, f"the CPU attention kernel is not available here: {why}\n")
    contexts = [int(c) for c in args.contexts.split(",")]
    rows_list = [int(r) for r in args.rows.split(",")]
    layouts = args.scores.split(",")
    if bad := set(layouts) - set(SCORE_LAYOUTS):
        ap.error(f"--scores takes {', '.join(SCORE_LAYOUTS)}; got {', '.join(sorted(bad))}")
    capacity = max(contexts) + max(rows_list)
    keys = jax.random.split(jax.random.key(0), 3)
    k = jax.random.normal(keys[0], (1, capacity, KV_HEADS, HEAD_DIM))
    v = jax.random.normal(keys[1], (1, capacity, KV_HEADS, HEAD_DIM))
    attend = {layout: jax.jit(lambda q, length, mask, layout=layout: cache_attention(
        q, k, v, length, mask, HEAD_DIM ** -0.5, scores=layout)) for layout in layouts}
    table = []
    for context in contexts:
        for rows in rows_list:
            q = jax.random.normal(keys[2], (1, rows, HEADS, HEAD_DIM))
            length = jnp.array([context], jnp.int32)
            mask = jnp.tril(jnp.ones((1, rows, rows), bool))  # a chain: each row its ancestors
            # The layouts take turns, ROUNDS rounds of runs / ROUNDS calls each, so that a
            # slow spell of a shared machine lands on all of them; the median of the rounds'.
            per_round = max(1, args.runs // ROUNDS)
            medians = {layout: [] for layout in layouts}
            for _ in range(ROUNDS):
                for layout, fn in attend.items():
                    t = time_calls(lambda fn=fn: fn(q, length, mask), per_round)  # noqa: B023
                    medians[layout].append(t["median_ms"])
            read = 2 * (context + rows) * KV_HEADS * HEAD_DIM * 4  # K and V rows, once
            for layout in layouts:
                ms = float(np.median(medians[layout]))
                row = {"context": context, "rows": rows, "scores": layout,
                       "us_per_layer": 1e3 * ms, "ms_per_forward": LAYERS * ms,
                       "kv_gb_s": read / (ms / 1e3) / 1e9}
                table.append(row)
                print(f"context {context:5d}, {rows:2d} rows, {layout:5s}: "
                      f"{row['us_per_layer']:7.1f} us a layer, {row['ms_per_forward']:5.2f} ms "
                      f"a forward, K/V read at {row['kv_gb_s']:5.1f} GB/s", flush=True)
    if args.out:
        write_json(args.out, {"benchmark": "cpu_attention_cost", "runs": args.runs,
                              "shape": {"layers": LAYERS, "heads": HEADS,
                                        "kv_heads": KV_HEADS, "head_dim": HEAD_DIM},
                              "table": table, "machine": machine_info()})


if __name__ == "__main__":
    main()
