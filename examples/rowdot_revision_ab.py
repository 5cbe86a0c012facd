"""The CPU rowdot kernel of a git revision against the working tree's, on the target's forward:
the same SmolLM2-135M forward (30 layers + LM head + argmax) over T = 1..16 rows of a
``--context``-row cache, traced once with each kernel and timed call by call in turn (ABBA);
best and median of ``--runs`` calls each, and the median of the runs' paired ratios with a
95% interval (adjacent calls share the host's drift). Each kernel's forward donates its
cache and gets the written one back for the next call, as the decode loop carries it (a
cache passed in and kept would be copied to take the new rows: about 1 ms a forward at 300
rows, 15 at 900, which would dilute the kernels' ratio). Writes JSON. ``--products``: only
the forward's weight products instead (30 layers' Q/K/V, O, gate/up and down, then the LM
head, on random weights of those shapes), streamed from memory, or with ``--cached`` one 960
x 576 matrix 120 times over (2.2 MB, in the last-level cache: the kernel's compute rate
alone).

    python examples/rowdot_revision_ab.py --rev HEAD~1 --out results/rowdot_ab.json
    python examples/rowdot_revision_ab.py --rev HEAD~1 --products --rows 6,12,14
    python examples/rowdot_revision_ab.py --rev HEAD~1 --products --march haswell   # AVX2 build

The revision's ``kernels/cpu_rowdot.cc`` is compiled with the flags ``cpu_rowdot`` uses, its
handler symbol renamed, and registered as a second FFI target; the forward traced while
``cpu_rowdot.TARGET`` names it calls that kernel (the name is read at trace time). Both
forwards must give the same tokens. T = 1 is a vanilla step; T = 2 and 10 are the shipped
chain's verify without and with its lookup chain.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import specjax
import specjax.kernels.cpu_build as cpu_build
import specjax.kernels.cpu_rowdot as cpu_rowdot
from specjax.defaults import resolve_model
from specjax.model import forward_hidden, init_cache, is_out_major, lm_head


def register_revision(rev: str) -> str:
    """Build ``rev``'s kernel and register it; returns its FFI target name. The shared
    headers (from the fiftieth session on) are taken from the same revision."""
    def show(path: str) -> str | None:
        proc = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
        return proc.stdout if proc.returncode == 0 else None

    folder = Path(tempfile.mkdtemp(prefix="rowdot_ab_"))
    (folder / "rowdot.cc").write_text(show("kernels/cpu_rowdot.cc"))
    for header in cpu_build._HEADERS:
        text = show(f"kernels/{header.name}")
        if text is not None:
            (folder / header.name).write_text(text)
    cmd = ["g++", *cpu_build._FLAGS, "-w", "-DSpecjaxRowDot=SpecjaxRowDotBase",
           "-I", jax.ffi.include_dir(), "-I", str(folder), str(folder / "rowdot.cc"),
           "-o", str(folder / "lib.so")]
    subprocess.run(cmd, check=True)
    lib = ctypes.cdll.LoadLibrary(str(folder / "lib.so"))
    name = "specjax_cpu_rowdot_base"
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(lib.SpecjaxRowDotBase), platform="cpu")
    return name


# One layer's products as [out, in] weights (fused Q/K/V, O, fused gate/up, down), and the
# tied LM head: SmolLM2-135M's shapes.
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)


def forward_case(args) -> tuple:
    """The target's forward (+ LM head + argmax) at T rows: (make_fn, example(T),
    carry(example, out) -> the next call's example, what). Every case's function returns a
    tuple whose first item is what both kernels must agree on."""
    target = specjax.load(resolve_model(None, progress=False))
    if not is_out_major(target.params):
        raise SystemExit("the target was not loaded out-major here (no rowdot kernel, or "
                         "SPECJAX_CPU_ROWDOT=off): there is no kernel to compare")
    cfg, params = target.cfg, target.params
    cache = dataclasses.replace(init_cache(cfg, 1, args.context + 64),
                                lengths=jnp.full((1,), args.context, jnp.int32))

    def make():
        # A new function each time: JAX reuses a function's trace, which names one kernel.
        def forward(p, t, pos, c):
            hidden, c, _ = forward_hidden(p, cfg, t, pos, c)
            return jnp.argmax(lm_head(p, hidden), -1), c

        return jax.jit(forward, donate_argnums=3)

    def example(m: int) -> tuple:
        # Every call writes the same rows (positions context .. context + m - 1).
        return (params, jnp.ones((1, m), jnp.int32),
                args.context + jnp.arange(m, dtype=jnp.int32)[None],
                jax.tree.map(jnp.copy, cache))

    def carry(example: tuple, out: tuple) -> tuple:
        return (*example[:3], out[1])  # the donated cache's successor

    return make, example, carry, "jitted forward_hidden + lm_head + argmax, B=1, cache carried"


def products_case(args) -> tuple:
    """The forward's weight products alone at M rows: (make_fn, example(M), carry, what);
    nothing is carried."""
    rng = np.random.default_rng(0)
    if args.cached:
        w = jnp.asarray(rng.standard_normal((960, 576), np.float32) * 0.02)
        ws = [w] * 120
    else:
        ws = [jnp.asarray(rng.standard_normal(s, np.float32) * 0.02)
              for s in LAYER * 30 + [HEAD]]

    def make():
        return jax.jit(lambda xs, ws: ([cpu_rowdot.rowdot(xs[w.shape[1]], w) for w in ws],))

    def example(m: int) -> tuple:  # the same x for every call at m rows
        xs = np.random.default_rng(m)
        return ({k: jnp.asarray(xs.standard_normal((m, k), np.float32)) for k in (576, 1536)},
                ws)

    what = "one 960 x 576 matrix x 120 (cached)" if args.cached else "30 layers' products + LM head"
    return make, example, lambda example, out: example, what


def paired_ratio(base_ms: np.ndarray, new_ms: np.ndarray, draws: int = 10_000) -> dict:
    """The median over runs of new / base, each run's two calls adjacent in time, and its 95%
    interval from resampling runs. The host's speed drifts by tens of percent within a
    minute (other tenants, clocks); adjacent calls share the drift, so their ratio cancels
    it where the two kernels' separate medians do not."""
    ratios = new_ms / base_ms
    pick = np.random.default_rng(0).integers(0, len(ratios), (draws, len(ratios)))
    lo, hi = np.percentile(np.median(ratios[pick], axis=1), [2.5, 97.5])
    return {"ratio": float(np.median(ratios)), "ci95": [float(lo), float(hi)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD", help="git revision to compare with (default HEAD)")
    ap.add_argument("--rows", default="1,2,3,4,6,8,10,12,16")
    ap.add_argument("--context", type=int, default=300, help="committed cache rows")
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--products", action="store_true",
                    help="time the forward's weight products alone, not the forward")
    ap.add_argument("--cached", action="store_true",
                    help="with --products: one cache-resident matrix, the compute rate alone")
    ap.add_argument("--march", default=None,
                    help="build both kernels for this -march instead of the host's (e.g. "
                         "haswell: the AVX2 build, on an AVX-512 host)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.cached and not args.products:
        ap.error("--cached goes with --products")
    if args.march:
        # Before either kernel is built: the working tree's build is keyed by its flags, so
        # the host's own build stays where it is.
        cpu_build._FLAGS = tuple(f"-march={args.march}" if f.startswith("-march=") else f
                                 for f in cpu_build._FLAGS)
    ok, why = cpu_rowdot.available()
    if not ok:
        raise SystemExit(f"the rowdot kernel is not available here: {why}")
    make, example_of, carry, what = (products_case if args.products else forward_case)(args)
    kernels = {args.rev: register_revision(args.rev), "working tree": cpu_rowdot.TARGET}

    def traced(name: str, example: tuple):
        """A fresh jit, traced while ``TARGET`` is ``name``."""
        default, cpu_rowdot.TARGET = cpu_rowdot.TARGET, name
        try:
            return make().lower(*example).compile()
        finally:
            cpu_rowdot.TARGET = default

    rows = {}
    for m in (int(x) for x in args.rows.split(",")):
        examples = {k: example_of(m) for k in kernels}  # each kernel's own (donated) cache
        fns = {k: traced(name, examples[k]) for k, name in kernels.items()}
        outs = {}
        for k, f in fns.items():
            out = f(*examples[k])
            examples[k] = carry(examples[k], out)
            outs[k] = jax.tree.leaves(out[0])
        first = outs[args.rev]  # the tokens (forward) or the products
        assert all((np.asarray(a) == np.asarray(b)).all()
                   for o in outs.values() for a, b in zip(o, first, strict=True)), \
            "the kernels disagree"
        ms = {k: [] for k in fns}
        order = list(fns)
        for _ in range(args.runs):
            for k in order:
                t = time.perf_counter()
                out = jax.block_until_ready(fns[k](*examples[k]))
                ms[k].append(1e3 * (time.perf_counter() - t))
                examples[k] = carry(examples[k], out)
            order.reverse()  # ABBA: neither kernel always runs right after the other
        rows[m] = {k: {"best_ms": min(v), "median_ms": float(np.median(v))}
                   for k, v in ms.items()}
        rows[m]["paired"] = paired_ratio(*(np.array(ms[k]) for k in kernels))
        p = rows[m]["paired"]
        print(f"T={m:>2}: " + "   ".join(f"{k} {rows[m][k]['best_ms']:.1f} / "
                                         f"{rows[m][k]['median_ms']:.1f} ms" for k in kernels)
              + f"   (best / median; working tree / {args.rev}, call by call: "
                f"{p['ratio']:.3f} [{p['ci95'][0]:.3f}, {p['ci95'][1]:.3f}])")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(
            {"rev": args.rev, "march": args.march or "native", "context": args.context,
             "runs": args.runs, "what": what, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
