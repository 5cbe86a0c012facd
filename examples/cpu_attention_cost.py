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

from specjax.bench.common import machine_info, write_json
from specjax.bench.timing import time_calls
from specjax.kernels.cpu_attention import available, cache_attention

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="50,500,1000")
    ap.add_argument("--rows", default="1,4,12")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    ok, why = available()
    if not ok:
        ap.exit(1, f"the CPU attention kernel is not available here: {why}\n")
    contexts = [int(c) for c in args.contexts.split(",")]
    rows_list = [int(r) for r in args.rows.split(",")]
    capacity = max(contexts) + max(rows_list)
    keys = jax.random.split(jax.random.key(0), 3)
    k = jax.random.normal(keys[0], (1, capacity, KV_HEADS, HEAD_DIM))
    v = jax.random.normal(keys[1], (1, capacity, KV_HEADS, HEAD_DIM))
    attend = jax.jit(lambda q, length, mask: cache_attention(q, k, v, length, mask,
                                                             HEAD_DIM ** -0.5))
    table = []
    for context in contexts:
        for rows in rows_list:
            q = jax.random.normal(keys[2], (1, rows, HEADS, HEAD_DIM))
            length = jnp.array([context], jnp.int32)
            mask = jnp.tril(jnp.ones((1, rows, rows), bool))  # a chain: each row its ancestors
            t = time_calls(lambda: attend(q, length, mask), args.runs)  # noqa: B023
            read = 2 * (context + rows) * KV_HEADS * HEAD_DIM * 4  # K and V rows, once
            row = {"context": context, "rows": rows, "us_per_layer": 1e3 * t["median_ms"],
                   "ms_per_forward": LAYERS * t["median_ms"],
                   "kv_gb_s": read / (t["median_ms"] / 1e3) / 1e9}
            table.append(row)
            print(f"context {context:5d}, {rows:2d} rows: {row['us_per_layer']:7.1f} us a layer, "
                  f"{row['ms_per_forward']:5.2f} ms a forward, K/V read at "
                  f"{row['kv_gb_s']:5.1f} GB/s", flush=True)
    if args.out:
        write_json(args.out, {"benchmark": "cpu_attention_cost", "runs": args.runs,
                              "shape": {"layers": LAYERS, "heads": HEADS,
                                        "kv_heads": KV_HEADS, "head_dim": HEAD_DIM},
                              "table": table, "machine": machine_info()})


if __name__ == "__main__":
    main()
