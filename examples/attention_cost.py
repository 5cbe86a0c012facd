"""The dense attention of one SmolLM2-135M forward (30 layers, GQA 9 query / 3 KV heads of
64, a 320-row cache) at T = 1, 4, 8 new rows, in the cache's layout ([B, S, K, D]) and
head-major ([B, K, S, D]): the part of a verify forward that grows with T besides the
weight products. Best of --runs, one jitted call over all layers.

    python examples/attention_cost.py --rows 1,4,8 --runs 25
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from specjax.bench.timing import time_calls
from specjax.model import cache_mask

LAYERS, CAPACITY, KV_HEADS, GROUP, HEAD_DIM, CONTEXT = 30, 320, 3, 3, 64, 200


def _attend(layout: str):
    kv = "bskd" if layout == "cache" else "bksd"

    @jax.jit
    def f(q, k_buf, v_buf, mask):  # q [L, B, T, K, G, D], k/v [L, B, S, K, D] or [L, B, K, S, D]
        outs = []
        for i in range(LAYERS):
            s = jnp.einsum(f"btkgd,{kv}->bkgts", q[i], k_buf[i],
                           preferred_element_type=jnp.float32) * HEAD_DIM ** -0.5
            s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
            outs.append(jnp.einsum(f"bkgts,{kv}->btkgd", jax.nn.softmax(s, axis=-1), v_buf[i]))
        return outs
    return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--runs", type=int, default=25)
    args = ap.parse_args()
    keys = jax.random.split(jax.random.key(0), 3)
    shape = (LAYERS, 1, CAPACITY, KV_HEADS, HEAD_DIM)
    k_buf, v_buf = jax.random.normal(keys[0], shape), jax.random.normal(keys[1], shape)
    head_major = [jnp.transpose(x, (0, 1, 3, 2, 4)) for x in (k_buf, v_buf)]
    for t in (int(r) for r in args.rows.split(",")):
        q = jax.random.normal(keys[2], (LAYERS, 1, t, KV_HEADS, GROUP, HEAD_DIM))
        mask = cache_mask(jnp.array([CONTEXT]), jnp.tril(jnp.ones((1, t, t), bool)), CAPACITY)
        f, g = _attend("cache"), _attend("head-major")
        cache = time_calls(lambda: f(q, k_buf, v_buf, mask), args.runs)["best_ms"]  # noqa: B023
        heads = time_calls(lambda: g(q, *head_major, mask), args.runs)["best_ms"]  # noqa: B023
        print(f"T={t:2d}  cache layout {cache:6.2f} ms  head-major {heads:6.2f} ms", flush=True)


if __name__ == "__main__":
    main()
