"""The target's prefill in one pass against chunks of rows (``SPECJAX_PREFILL_CHUNK``).

For each prompt length L the prompt is a bucket of P = bucket(L) ids (random, fixed seed)
whose first L are valid, in a cache sized as a 128-token run's (P + 128 + 16 rows), and
:func:`specjax.loop.prefill_target` runs with each ``--chunks`` setting (0: one pass over
the whole bucket, as before the seventy-second session; ``default``: no override, the CPU's
128-row chunks with a 64-row last one), each traced from a new function (the setting is read
at trace time). Every setting's hidden states at the valid positions are checked against the
one pass's first (max |difference| in the JSON), then all are timed in ``--rounds``
interleaved rounds of ``--runs`` calls after one untimed call
(:func:`specjax.bench.timing.time_calls`; the median of the rounds' best, ms). Writes JSON
and a plot of ms against L.

    python examples/prefill_chunks.py --out results/prefill_chunks.json
"""

from __future__ import annotations

import argparse
import os
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.bench.common import machine_info, pyplot, save_figure, write_json
from specjax.bench.timing import time_calls
from specjax.loop import bucket, prefill_target


def traced(target: Any, chunk: int | None, capacity: int, prompt: Any,
           lens: Any) -> tuple[Any, Any]:
    """A new jitted prefill traced with ``SPECJAX_PREFILL_CHUNK = chunk`` (None: unset), and
    its first call's hidden states. The setting is read at trace time, so it is set only
    for that first call and the caller's value restored after it."""
    saved = os.environ.pop("SPECJAX_PREFILL_CHUNK", None)
    if chunk is not None:
        os.environ["SPECJAX_PREFILL_CHUNK"] = str(chunk)
    try:
        fn = jax.jit(lambda params, prompt, lens: prefill_target(params, target.cfg, prompt,
                                                                 lens, capacity)[0])
        return fn, np.asarray(fn(target.params, prompt, lens))
    finally:
        os.environ.pop("SPECJAX_PREFILL_CHUNK", None)
        if saved is not None:
            os.environ["SPECJAX_PREFILL_CHUNK"] = saved


def measure(target: Any, length: int, chunks: list[int | None], runs: int, rounds: int,
            seed: int = 0) -> list[dict[str, Any]]:
    """One row per chunk setting for a prompt of ``length`` valid ids (see the module)."""
    p = bucket(length)
    capacity = p + 128 + 16
    prompt = jnp.asarray(np.random.default_rng(seed).integers(
        3, target.cfg.vocab_size, (1, p)), jnp.int32)
    lens = jnp.asarray([length], jnp.int32)
    fns, outs = {}, {}
    for c in chunks:
        fns[c], hidden = traced(target, c, capacity, prompt, lens)
        outs[c] = hidden[0, :length]
    ref = outs[0] if 0 in outs else outs[chunks[0]]
    best: dict[int | None, list[float]] = {c: [] for c in chunks}
    for r in range(rounds):
        for c in chunks[r % len(chunks):] + chunks[:r % len(chunks)]:  # rotated order
            call = partial(fns[c], target.params, prompt, lens)
            best[c].append(time_calls(call, runs)["best_ms"])
    return [{"length": length, "bucket": p, "chunk": c, "ms": float(np.median(best[c])),
             "round_best_ms": best[c],
             "max_abs_diff": float(np.max(np.abs(outs[c] - ref)))} for c in chunks]


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in dict.fromkeys(r["chunk"] for r in rows):
        pts = sorted((r["length"], r["ms"]) for r in rows if r["chunk"] == c)
        label = ("one pass over the bucket" if c == 0 else "the default" if c is None
                 else f"chunks of {c}")
        ax.plot(*zip(*pts, strict=True), marker="o", label=label)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill ms (median of rounds' best)")
    ax.legend()
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a converted target (default: SmolLM2)")
    ap.add_argument("--lengths", default="64,200,450,700,1000")
    ap.add_argument("--chunks", default="0,64,default",
                    help="0 = one pass; default = no override")
    ap.add_argument("--runs", type=int, default=2, help="timed calls a round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write JSON here (and a .png beside it)")
    args = ap.parse_args(argv)
    import specjax
    from specjax.defaults import resolve_model

    target = specjax.load(resolve_model(args.model, progress=False))
    chunks = [None if c == "default" else int(c) for c in args.chunks.split(",")]
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        new = measure(target, length, chunks, args.runs, args.rounds)
        one = next((r["ms"] for r in new if r["chunk"] == 0), None)
        for row in new:
            row["vs_one_pass"] = None if one is None else row["ms"] / one
            rows.append(row)
            print(f"L {length:5d} (bucket {row['bucket']:5d})  chunk {row['chunk']!s:>7}  "
                  f"{row['ms']:8.1f} ms" + ("" if one is None else
                                            f"  {row['vs_one_pass']:.3f} of one pass")
                  + f"  max |diff| {row['max_abs_diff']:.1e}", flush=True)
    result = {"rows": rows, "runs": args.runs, "rounds": args.rounds,
              "machine": machine_info()}
    if args.out:
        out = write_json(Path(args.out), result)
        result["plot"] = str(plot(rows, out.with_suffix(".png")))
    return result


if __name__ == "__main__":
    main()
