"""``specjax bench latency``: target forward latency against the tokens per forward (T).

A speculative step verifies a tree of T nodes in one target forward, so what a tree can gain
depends on how much more a T-token forward costs than a 1-token one (a vanilla decode
step). This benchmark measures that curve: the jitted verify forward (``forward_hidden`` +
``lm_head`` + argmax over every row, B=1, a cache of ``capacity`` rows with ``context``
committed, threaded and donated from call to call as the loop does) for T = 1..64, best and
median of ``runs`` rounds, every size timed once per round so a burst of other load spreads
over all sizes.

In the same process it measures what the machine can do at best: the streaming read
bandwidth (``bench.common.measure_bandwidth``) and the fp32 GEMM throughput of one large
jitted matrix product. The physical floor of a T-token forward is then
``max(weight bytes / bandwidth, 2 * T * matmul parameters / GEMM throughput)``: every weight
read once, every multiply-add done at the best measured rate.

Output: JSON and a PNG (latency and × T=1 against T; ``--compare`` overlays an earlier
result, e.g. the curve before a change).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from specjax.bench.common import (
    as_command,
    decode_weight_bytes,
    int_list,
    machine_info,
    measure_bandwidth,
    pyplot,
    save_figure,
    write_json,
)
from specjax.bench.timing import monotone_fit, verify_call
from specjax.defaults import resolve_model

SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)
GOALS = {4: 1.2, 8: 1.45}  # issue 10: latency(T) / latency(1) at most this


def matmul_params(params: Any) -> int:
    """Multiply-adds per token of one forward: every 2-D weight but the input embedding,
    plus the LM head (V x d). Attention over the cache is not counted."""
    n = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params.layers)
            if x.ndim == 2)
    return n + int(np.prod(params.head.shape))


def measure_gemm_gflops(runs: int = 5, m: int = 512, k: int = 576, n: int = 3072) -> float:
    """fp32 GEMM throughput of one jitted [m, k] x [k, n] product, in GFLOP/s (best of runs).

    Large enough that XLA:CPU runs it compute-bound on every core; what a T-token forward
    could reach once its products stop being limited by memory.
    """
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((m, k), np.float32))
    b = jnp.asarray(rng.standard_normal((k, n), np.float32))
    f = jax.jit(lambda a, b: a @ b)
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best / 1e9


def physical_floor_ms(sizes: list[int], weight_bytes: int, macs_per_token: int,
                      read_gb_s: float, gflops: float) -> list[float]:
    """Per T: max(stream every weight once, do every multiply-add at the GEMM rate), ms."""
    return [1e3 * max(weight_bytes / (read_gb_s * 1e9), 2 * t * macs_per_token / (gflops * 1e9))
            for t in sizes]


LAYOUTS = {"fused": "Q/K/V and gate/up fused (what specjax.load gives)",
           "unfused": "separate Q, K, V, gate, up products (the stored layout)"}


def variant_params(params: Any, layout: str) -> Any:
    """``params`` in one of :data:`LAYOUTS`."""
    from specjax.model import fuse_params, unfuse_params

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    return fuse_params(params) if layout == "fused" else unfuse_params(params)


def latency_curves(target: Any, variants: dict[str, Any], sizes: tuple[int, ...], *,
                   context: int, capacity: int, runs: int,
                   bar: tqdm | None = None) -> dict[str, dict[str, list[float]]]:
    """Best and median ms per T for each ``variants`` entry (name -> params), interleaved:
    every (variant, T) is compiled first, then each round times each of them once."""
    import dataclasses

    calls = {}
    for name, params in variants.items():
        tv = dataclasses.replace(target, params=params)
        for t in sizes:
            if bar is not None:
                bar.set_description(f"{name} T={t} (compile)")
            calls[name, t] = verify_call(tv, t, context=context, capacity=capacity)
            jax.block_until_ready(calls[name, t]())
            if bar is not None:
                bar.update()
    times: dict[tuple[str, int], list[float]] = {k: [] for k in calls}
    for i in range(runs):
        if bar is not None:
            bar.set_description(f"round {i + 1}/{runs}")
        for k, call in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            times[k].append(1e3 * (time.perf_counter() - t0))
    return {name: {"best_ms": [min(times[name, t]) for t in sizes],
                   "median_ms": [float(np.median(times[name, t])) for t in sizes]}
            for name in variants}


def run_latency_bench(model_dir: Path, *, sizes: tuple[int, ...] = SIZES, context: int = 200,
                      capacity: int = 320, runs: int = 7, dtype: str | None = None,
                      layouts: tuple[str, ...] = ("fused",),
                      out: Path = Path("results/bench_latency.json"), label: str = "",
                      compare: Path | None = None) -> dict[str, Any]:
    """Measure the target's forward latency curve; write ``out`` (JSON) and a PNG beside it.

    Args:
      context: committed cache rows (the prefix every new token attends to).
      capacity: cache rows allocated (attention runs over all of them, masked);
        at least ``context + max(sizes)``.
      runs: timed rounds; every size (of every layout) is timed once per round.
      layouts: weight layouts to time in the same run (:data:`LAYOUTS`); the first is
        the headline curve, the others are reported beside it.
      label: a name for the headline curve (e.g. "before", "after"), shown in the plot.
      compare: an earlier result of this benchmark to overlay and compare with.
    """
    import specjax

    sizes = tuple(sorted(set(int(t) for t in sizes)))
    if sizes[0] < 1 or runs < 1:
        raise ValueError("sizes must be >= 1 and runs >= 1")
    if context + sizes[-1] > capacity:
        raise ValueError(f"context {context} + T={sizes[-1]} exceeds capacity {capacity}")
    if not layouts:
        raise ValueError("give at least one layout")
    model_dir, out = Path(model_dir), Path(out)
    before = json.loads(Path(compare).read_text()) if compare is not None else None
    target = specjax.load(model_dir, dtype)
    variants = {name: variant_params(target.params, name) for name in layouts}
    bar = tqdm(total=len(sizes) * len(layouts) + 1, unit="step")
    bar.set_description("bandwidth + GEMM rate")
    bw = measure_bandwidth()
    gflops = measure_gemm_gflops()
    bar.update()
    curves = latency_curves(target, variants, sizes, context=context, capacity=capacity,
                            runs=runs, bar=bar)
    bar.close()
    for c in curves.values():
        c["ratio_to_t1"] = [b / c["best_ms"][0] for b in c["best_ms"]]
    main = curves[layouts[0]]
    best, ratio = main["best_ms"], main["ratio_to_t1"]
    wbytes = decode_weight_bytes(target.params)
    macs = matmul_params(target.params)
    floor = physical_floor_ms(list(sizes), wbytes, macs, bw["read_gb_s"], gflops)
    result = {
        "benchmark": "latency", "model_name": model_dir.name,
        "label": label or layouts[0], "layout": layouts[0],
        "dtype": str(target.params.embed.dtype), "machine": machine_info(),
        "what": "jitted forward_hidden + lm_head + argmax, B=1, causal block",
        "context": context, "capacity": capacity, "runs": runs,
        "sizes": list(sizes), "best_ms": best, "median_ms": main["median_ms"],
        "fit_ms": monotone_fit(best), "ratio_to_t1": ratio,
        "layouts": {name: {"what": LAYOUTS[name], **curves[name]} for name in layouts},
        "bandwidth": bw, "gemm_gflops": gflops, "weight_bytes": wbytes,
        "macs_per_token": macs, "physical_floor_ms": floor,
        "t1_fraction_of_floor": floor[0] / best[0],
        "goals": {str(t): {"max_ratio": g, "ratio": _ratio_at(sizes, ratio, t),
                           "met": None if _ratio_at(sizes, ratio, t) is None
                           else _ratio_at(sizes, ratio, t) <= g}
                  for t, g in GOALS.items()},
        "compare": None if before is None else {
            "label": before.get("label", ""), "sizes": before["sizes"],
            "best_ms": before["best_ms"], "ratio_to_t1": before["ratio_to_t1"]},
    }
    write_json(out, result)
    plot_latency(result, out.with_suffix(".png"))
    print(summary(result))
    return result


def _ratio_at(sizes: tuple[int, ...], ratio: list[float], t: int) -> float | None:
    return ratio[sizes.index(t)] if t in sizes else None


def plot_latency(r: dict[str, Any], path: Path) -> Path:
    """Two panels: latency (ms) and latency / latency(T=1), against T (log x)."""
    plt = pyplot()

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    name = r["label"] or "this run"
    a1.plot(r["sizes"], r["best_ms"], "o-", label=f"{name}: best of {r['runs']}")
    a1.plot(r["sizes"], r["median_ms"], "x", alpha=0.5, label=f"{name}: median")
    a1.plot(r["sizes"], r["physical_floor_ms"], "k--", lw=1,
            label=f"physical floor ({r['bandwidth']['read_gb_s']:.1f} GB/s, "
                  f"{r['gemm_gflops']:.0f} GFLOP/s)")
    a2.plot(r["sizes"], r["ratio_to_t1"], "o-", label=name)
    for other, c in r.get("layouts", {}).items():
        if other != r.get("layout"):
            a1.plot(r["sizes"], c["best_ms"], "^-", alpha=0.7, label=f"{other}: best")
            a2.plot(r["sizes"], c["ratio_to_t1"], "^-", alpha=0.7, label=other)
    c = r.get("compare")
    if c:
        cname = c["label"] or "compared run"
        a1.plot(c["sizes"], c["best_ms"], "s:", color="tab:gray", label=f"{cname}: best")
        a2.plot(c["sizes"], c["ratio_to_t1"], "s:", color="tab:gray", label=cname)
    for t, g in GOALS.items():
        a2.plot([t], [g], "r*", ms=10)
    a2.plot([], [], "r*", label="goal (issue 10)")
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(r["sizes"], [str(t) for t in r["sizes"]], fontsize=7)
        ax.set_xlabel("tokens per target forward (T)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    a1.set_ylabel("ms")
    a1.set_title(f"{r['model_name']} {r['dtype']} forward + LM head, B=1, cache "
                 f"{r['context']}/{r['capacity']} rows", fontsize=10)
    a2.set_ylabel("latency / latency(T=1)")
    a2.set_title("Cost of a T-token verify in decode steps", fontsize=10)
    return save_figure(fig, path)


def summary(r: dict[str, Any]) -> str:
    """A short table of one result (and of the compared one, if any)."""
    head = f"{'T':>4}{'best ms':>10}{'median':>9}{'x T=1':>8}{'floor ms':>10}"
    c = r.get("compare")
    cmp = {}
    if c:
        head += f"{'before ms':>11}{'x T=1':>8}{'after/before':>14}"
        cmp = {t: (ms, x) for t, ms, x in zip(c["sizes"], c["best_ms"], c["ratio_to_t1"],
                                              strict=True)}
    lines = [f"{r['model_name']} {r['dtype']}, {r['what']}, cache {r['context']}/"
             f"{r['capacity']}, best of {r['runs']} ({r['label'] or 'unlabelled'})", head]
    for t, b, m, x, f in zip(r["sizes"], r["best_ms"], r["median_ms"], r["ratio_to_t1"],
                             r["physical_floor_ms"], strict=True):
        line = f"{t:>4}{b:>10.1f}{m:>9.1f}{x:>8.2f}{f:>10.1f}"
        if t in cmp:
            line += f"{cmp[t][0]:>11.1f}{cmp[t][1]:>8.2f}{b / cmp[t][0]:>14.2f}"
        lines.append(line)
    bw = r["bandwidth"]
    lines.append(f"physical floor: {r['weight_bytes'] / 1e6:.0f} MB at {bw['read_gb_s']:.1f} GB/s "
                 f"read, {r['macs_per_token'] / 1e6:.0f}M multiply-adds per token at "
                 f"{r['gemm_gflops']:.0f} GFLOP/s; T=1 reaches {r['t1_fraction_of_floor']:.2f} "
                 "of it")
    for other, c in r.get("layouts", {}).items():
        if other != r.get("layout"):
            lines.append(f"{other} (same run): " + ", ".join(
                f"T={t}: {ms:.1f} ms ({x:.2f}x, {ms / b:.2f} of {r['layout']})"
                for t, ms, x, b in zip(r["sizes"], c["best_ms"], c["ratio_to_t1"],
                                       r["best_ms"], strict=True)))
    for t, g in r["goals"].items():
        if g["ratio"] is not None:
            lines.append(f"goal T={t}: <= {g['max_ratio']}x T=1, measured {g['ratio']:.2f}x "
                         f"({'met' if g['met'] else 'not met'})")
    return "\n".join(lines)


def add_latency_args(p: argparse.ArgumentParser) -> None:
    """Attach ``specjax bench latency``'s flags to a (sub)parser."""
    p.add_argument("--model", default=None,
                   help="converted target folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="cast parameters at load (default: as stored)")
    p.add_argument("--sizes", type=int_list, default=SIZES,
                   help="comma-separated T (default " + ",".join(map(str, SIZES)) + ")")
    p.add_argument("--context", type=int, default=200, help="committed cache rows (default 200)")
    p.add_argument("--capacity", type=int, default=320,
                   help="allocated cache rows, >= context + max T (default 320)")
    p.add_argument("--runs", type=int, default=7, help="timed rounds (default 7)")
    p.add_argument("--layouts", default="fused",
                   help="comma-separated weight layouts timed in the same run, the first is "
                        "the headline: " + ", ".join(f"{k} ({v})" for k, v in LAYOUTS.items())
                        + " (default fused)")
    p.add_argument("--label", default="", help="name of this curve in the plot and JSON")
    p.add_argument("--compare", default=None, help="an earlier result JSON to overlay")
    p.add_argument("--out", default="results/bench_latency.json")


def run_latency_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Run :func:`run_latency_bench` from :func:`add_latency_args`'s flags."""
    return run_latency_bench(resolve_model(args.model), sizes=args.sizes,
                             context=args.context, capacity=args.capacity, runs=args.runs,
                             dtype=args.dtype,
                             layouts=tuple(x for x in args.layouts.split(",") if x),
                             out=Path(args.out), label=args.label,
                             compare=None if args.compare is None else Path(args.compare))


def add_parser(bench: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``latency`` to ``specjax bench``'s subparsers; ``args.run`` runs it."""
    p = bench.add_parser(
        "latency", help="target forward latency against tokens per forward T (JSON + plot)")
    add_latency_args(p)
    p.set_defaults(run=as_command(run_latency_from_args))
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m specjax.bench.latency``: the same as ``specjax bench latency``."""
    p = argparse.ArgumentParser(prog="specjax bench latency", description=__doc__)
    add_latency_args(p)
    run_latency_from_args(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
