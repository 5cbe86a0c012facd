"""``specjax bench gemm``: shortlist logits against the full LM head, as one jitted call each.

For a head W [V, d] (default V=49152, d=576: SmolLM2-135M's; random weights, no model load)
and N hidden rows (default 1 and 4: a chain step and a small beam), three ways to get logits:

* **full head**: ``h @ W.T`` over all V entries, what the drafter pays without a shortlist;
* **gathered** (DynaSpec / EvoSpec style): ``gathered_matmul(h, W, idx)`` with a different
  shortlist per row, ``idx`` [N, C] random distinct ids (unsorted), the gather inside the call;
* **dense sub-matrix** (FR-Spec style): ``h @ W_C.T`` with ``W_C`` a contiguous [C, d] copy
  made beforehand, one static shortlist shared by every row.

for shortlist sizes C (default 1k to 32k). Each figure is the best of ``runs`` calls after a
compile call (jit, ``block_until_ready``); the speedup is the full head's time over it.
Output: JSON and a log-x PNG (time and speedup against C) beside it.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from tqdm import tqdm

from specjax.bench.common import (
    as_command,
    int_list,
    machine_info,
    pyplot,
    save_figure,
    write_json,
)
from specjax.bench.timing import time_calls
from specjax.kernels.gathered_gemm import chosen_impl, gathered_matmul

SIZES = (1024, 2048, 4096, 8192, 16384, 32768)
ROWS = (1, 4)
METHODS = ("gathered", "dense")
LABELS = {"gathered": "gathered W[idx] (per-row shortlist)",
          "dense": "dense sub-matrix W[:C] (FR-Spec)"}


@jax.jit
def _full_head(h: Array, w: Array) -> Array:
    """[N, d] x [V, d] -> [N, V] float32 logits."""
    return jnp.einsum("nd,vd->nv", h, w, preferred_element_type=jnp.float32)


@partial(jax.jit, static_argnames=("impl",))
def _gathered(h: Array, w: Array, idx: Array, impl: str) -> Array:
    """[N, d], [V, d], [N, C] -> [N, C] float32 logits of each row's own shortlist."""
    return gathered_matmul(h, w, idx, impl=impl)


def run_gemm_bench(*, vocab_size: int = 49152, hidden_size: int = 576,
                   rows: tuple[int, ...] = ROWS, sizes: tuple[int, ...] = SIZES,
                   dtype: str = "float32", impl: str = "auto", runs: int = 10, seed: int = 0,
                   out: str | Path = "results/bench_gemm.json") -> dict[str, Any]:
    """Time the full head, the gathered path and a dense sub-matrix; write JSON and a PNG.

    Args:
      vocab_size, hidden_size: the head's shape [V, d].
      rows: the N values (hidden rows per call).
      sizes: shortlist sizes C, each at most ``vocab_size``.
      dtype: the weights' and hidden states' dtype; logits are float32 throughout.
      impl: ``gathered_matmul``'s implementation ("auto": Pallas on a GPU, the CPU rowdot
        kernel where it takes the rows, else XLA; :func:`chosen_impl`).
      runs: timed calls per figure (the best is reported, the median recorded).
    Returns:
      The dict written to ``out``; per N (key "N=<n>"), lists aligned with ``sizes``.
    """
    sizes, rows = tuple(sorted(sizes)), tuple(rows)
    if not sizes or sizes[0] < 1 or sizes[-1] > vocab_size:
        raise ValueError(f"shortlist sizes must lie in [1, vocab_size={vocab_size}], "
                         f"got {list(sizes)}")
    if not rows or min(rows) < 1:
        raise ValueError(f"rows must be positive, got {list(rows)}")
    out = Path(out)
    itemsize = jnp.dtype(dtype).itemsize
    kw, kh = jax.random.split(jax.random.key(seed))
    w = jax.random.normal(kw, (vocab_size, hidden_size), dtype)
    rng = np.random.default_rng(seed)

    bar = tqdm(total=len(rows) * (1 + len(METHODS) * len(sizes)), unit="bench")
    per_n: dict[str, dict[str, Any]] = {}
    impls: dict[str, str] = {}
    for n in rows:
        h = jax.random.normal(jax.random.fold_in(kh, n), (n, hidden_size), dtype)
        impls[f"N={n}"] = chosen_impl(h, w, impl)
        # Prefixes of a permutation: each row's C ids are distinct, and rows differ.
        perm = np.stack([rng.permutation(vocab_size)[:sizes[-1]] for _ in range(n)])
        bar.set_description(f"N={n} full head")
        full = time_calls(lambda h=h: _full_head(h, w), runs)
        bar.update()
        res: dict[str, Any] = {"full_head_ms": full["best_ms"],
                               "full_head_median_ms": full["median_ms"],
                               "full_head_gb_s": vocab_size * hidden_size * itemsize
                               / full["best_ms"] / 1e6}
        for method in METHODS:
            best, median = [], []
            for c in sizes:
                bar.set_description(f"N={n} {method} C={c}")
                if method == "gathered":
                    idx = jnp.asarray(perm[:, :c], jnp.int32)
                    t = time_calls(lambda h=h, idx=idx: _gathered(h, w, idx, impl), runs)
                else:
                    sub = w[:c]  # its own [C, d] buffer, made once like FR-Spec's sliced head
                    t = time_calls(lambda h=h, sub=sub: _full_head(h, sub), runs)
                best.append(t["best_ms"])
                median.append(t["median_ms"])
                bar.update()
            # Bytes of W each call must read: N rows' own shortlists, or one shared C x d.
            read = [(n if method == "gathered" else 1) * c * hidden_size * itemsize
                    for c in sizes]
            res[method] = {"ms": best, "median_ms": median,
                           "speedup": [full["best_ms"] / t for t in best],
                           "gb_s": [b / t / 1e6 for b, t in zip(read, best, strict=True)]}
        per_n[f"N={n}"] = res
    bar.close()

    result = {
        "benchmark": "gemm", "vocab_size": vocab_size, "hidden_size": hidden_size,
        "dtype": dtype, "impl": "/".join(dict.fromkeys(impls.values())), "impl_by_rows": impls,
        "rows": list(rows), "sizes": list(sizes),
        "runs": runs, "seed": seed, "machine": machine_info(), "results": per_n,
        "methods": LABELS,
        "idx": "random distinct ids per row (prefixes of a permutation), unsorted, int32",
        "timing": "best of `runs` jitted calls after a compile call, block_until_ready; "
                  "speedup = full head best / method best; gb_s = W bytes the method must "
                  "read / best time",
    }
    write_json(out, result)
    plot_gemm(result, out.with_suffix(".png"))
    print(summary(result))
    return result


def _size_label(c: int) -> str:
    return f"{c // 1024}k" if c % 1024 == 0 else str(c)


def plot_gemm(r: dict[str, Any], path: Path) -> Path:
    """Time (left) and speedup over the full head (right) against C, log-x, one line per
    method and N; the full head's time is a dashed line per N."""
    plt = pyplot()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.4))
    sizes = r["sizes"]
    styles = {"gathered": "o-", "dense": "s--"}
    for i, (name, res) in enumerate(r["results"].items()):
        color = f"C{i}"
        ax1.axhline(res["full_head_ms"], color=color, linestyle=":", linewidth=1,
                    label=f"{name} full head (V={r['vocab_size']})")
        for m in METHODS:
            ax1.plot(sizes, res[m]["ms"], styles[m], color=color, label=f"{name} {m}")
            ax2.plot(sizes, res[m]["speedup"], styles[m], color=color, label=f"{name} {m}")
    ax2.axhline(1.0, color="k", linestyle="--", linewidth=1)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [_size_label(c) for c in sizes])
        ax.minorticks_off()
        ax.set_xlabel("shortlist size C")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7)
    ax1.set_ylabel("ms per call (best)")
    ax1.set_title("Logits over C candidates", fontsize=10)
    ax2.set_ylabel("speedup over the full head")
    ax2.set_title("full head time / method time", fontsize=10)
    fig.suptitle(f"V={r['vocab_size']}, d={r['hidden_size']}, {r['dtype']}, gathered impl "
                 f"{r['impl']}, {r['machine']['jax_backend']} ({r['machine']['nproc']} CPUs)",
                 fontsize=10)
    return save_figure(fig, path)


def summary(r: dict[str, Any]) -> str:
    """A human-readable table: ms (speedup over the full head) per method and C."""
    lines = [f"V={r['vocab_size']}, d={r['hidden_size']}, {r['dtype']}, gathered impl "
             f"{r['impl']} (best of {r['runs']}, ms; x = speedup over the full head)"]
    for name, res in r["results"].items():
        lines.append(f"{name}: full head {res['full_head_ms']:.3f} ms "
                     f"({res['full_head_gb_s']:.1f} GB/s)")
        lines.append(f"  {'C':>6}" + "".join(f"{m:>22}" for m in METHODS))
        for i, c in enumerate(r["sizes"]):
            cells = "".join(f"{res[m]['ms'][i]:>12.3f} ({res[m]['speedup'][i]:>5.1f}x)"
                            for m in METHODS)
            lines.append(f"  {_size_label(c):>6}{cells}")
    return "\n".join(lines)


def add_gemm_args(p: argparse.ArgumentParser) -> None:
    """Attach ``specjax bench gemm``'s flags to a (sub)parser."""
    p.add_argument("--vocab-size", type=int, default=49152,
                   help="V, rows of the random head (default 49152, SmolLM2's)")
    p.add_argument("--hidden-size", type=int, default=576,
                   help="d, the head's width (default 576, SmolLM2's)")
    p.add_argument("--rows", type=int_list, default=ROWS,
                   help="comma-separated N, hidden rows per call (default 1,4)")
    p.add_argument("--sizes", type=int_list, default=SIZES,
                   help="comma-separated shortlist sizes C (default 1024,...,32768)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--impl", default="auto", choices=["auto", "xla", "pallas", "rowdot"],
                   help="gathered_matmul implementation (default auto: Pallas on a GPU, the CPU "
                        "rowdot kernel where it takes the rows, else XLA)")
    p.add_argument("--runs", type=int, default=10, help="timed calls per figure (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/bench_gemm.json")


def run_gemm_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Run :func:`run_gemm_bench` from :func:`add_gemm_args`'s flags."""
    return run_gemm_bench(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                          rows=args.rows, sizes=args.sizes, dtype=args.dtype, impl=args.impl,
                          runs=args.runs, seed=args.seed, out=Path(args.out))


def add_parser(bench: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``gemm`` to ``specjax bench``'s subparsers; ``args.run`` runs it."""
    p = bench.add_parser(
        "gemm", help="gathered-column GEMM (XLA path) vs the full head, by shortlist size")
    add_gemm_args(p)
    p.set_defaults(run=as_command(run_gemm_from_args))
    return p
