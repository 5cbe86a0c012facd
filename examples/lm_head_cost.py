"""Where a target step goes on a large vocabulary: the decoder layers vs the full LM head.

One T=1 target forward (a decode step, 128 cached rows) timed whole, then as its two parts:
the layers with the final norm, and the LM head over the whole vocabulary (with the argmax
a greedy step takes). Also vanilla decode tokens/s. Prints JSON.

    python examples/lm_head_cost.py --model gemma3-270m
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp

import specjax
from specjax.defaults import resolve_model
from specjax.model import forward_hidden, init_cache, lm_head

PROMPT = "The three primary colours are red, yellow and blue. Mixing red and blue gives"


def _median_ms(f, *args, runs: int) -> float:
    f(*args).block_until_ready()  # compile
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        f(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="folder or named model (default SmolLM2)")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    target = specjax.load(resolve_model(args.model))
    cfg, params = target.cfg, target.params
    ids = target.tokenizer.encode(PROMPT)
    gen = dict(max_new_tokens=args.max_new_tokens, stop_on_eos=False, chat=False)
    specjax.generate(target, [ids], **gen)  # compile
    rates = [specjax.generate(target, [ids], **gen).stats["decode_tokens_per_s"]
             for _ in range(3)]

    cache = dataclasses.replace(init_cache(cfg, 1, 256), lengths=jnp.array([128]))
    tok, pos = jnp.array([[ids[-1]]]), jnp.array([[128]])
    layers = jax.jit(lambda p, c: forward_hidden(p, cfg, tok, pos, c)[0])
    head = jax.jit(lambda p, h: jnp.argmax(lm_head(p, h), -1))
    full = jax.jit(lambda p, c: head(p, layers(p, c)))
    t_layers = _median_ms(layers, params, cache, runs=args.runs)
    t_head = _median_ms(head, params, layers(params, cache), runs=args.runs)
    t_full = _median_ms(full, params, cache, runs=args.runs)
    print(json.dumps({
        "model": str(target.path), "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "decode_tokens_per_s": [round(r, 2) for r in rates],
        "forward_ms": round(t_full, 2), "layers_ms": round(t_layers, 2),
        "lm_head_ms": round(t_head, 2), "head_share_of_forward": round(t_head / t_full, 3),
        "head_over_layers": round(t_head / t_layers, 3),
        "layer_bytes": sum(x.nbytes for x in jax.tree.leaves(params.layers)),
        "head_bytes": int(params.head.nbytes),
    }, indent=1))


if __name__ == "__main__":
    main()
