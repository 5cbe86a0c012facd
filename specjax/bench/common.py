"""Shared benchmark pieces: bandwidth measurement, weight bytes, machine info, greedy-output
comparison, output files, command wiring."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.model import Params
from specjax.tree.default import machine_class

MB = 2**20
MAL_NOTE = ("MAL = tokens committed per target forward, the target's bonus token included "
            "(Spec-Bench / EAGLE convention; 1.0 means no draft token was ever accepted)")


def best_time(fn: Callable[[], Any], runs: int) -> float:
    """Fastest of ``runs`` calls, in seconds (the least disturbed by other load)."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_bandwidth(read_mb: int = 512, copy_mb: int = 256, runs: int = 5) -> dict[str, float]:
    """Measure main-memory bandwidth in this process, in GB/s (1e9 bytes/s).

    ``read_gb_s``: ``read_mb`` of float32 streamed once by jitted ``jnp.sum`` calls, one
    per usable core, each in its own thread over its own share, as a decode step's
    kernels read the weights on every core (one sum alone, ``read_one_gb_s``, read 27-39
    GB/s on a 2-core EPYC where both cores together read 40, and the compiled decode
    reached 36, above the one-sum "floor"); ``copy_gb_s``: ``np.copyto`` of a ``copy_mb``
    array, counting bytes read + written. Arrays should exceed the last-level cache
    (e.g. 260 MiB L3 on some Xeons), or the figure is cache bandwidth.
    """
    # Separate scopes so each buffer is freed before the next is allocated.
    cores = usable_cores()
    read = _read_gb_s(read_mb, runs, cores)
    return {"read_gb_s": read,
            "read_one_gb_s": read if cores == 1 else _read_gb_s(read_mb, runs, 1),
            "copy_gb_s": _copy_gb_s(copy_mb, runs),
            "read_mb": read_mb, "copy_mb": copy_mb, "runs": runs, "cores": cores}


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS says, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _read_gb_s(mb: int, runs: int, threads: int) -> float:
    """``mb`` read by ``threads`` concurrent sums; XLA releases the GIL while one runs."""
    parts = [jnp.ones((mb * MB // 4 // threads,), jnp.float32) for _ in range(threads)]
    total = jax.jit(jnp.sum)
    for p in parts:
        total(p).block_until_ready()  # compile, and fault the pages in
    with ThreadPoolExecutor(threads) as pool:
        def read_all() -> None:
            list(pool.map(lambda p: total(p).block_until_ready(), parts))
        seconds = best_time(read_all, runs)
    return sum(p.nbytes for p in parts) / seconds / 1e9


def _copy_gb_s(mb: int, runs: int) -> float:
    src = np.ones((mb * MB // 4,), np.float32)
    dst = np.zeros_like(src)
    np.copyto(dst, src)  # touch every destination page before timing
    return 2 * src.nbytes / best_time(lambda: np.copyto(dst, src), runs) / 1e9


def decode_weight_bytes(params: Params) -> int:
    """Parameter bytes one decode step reads.

    Every matrix is read in full except the input embedding, of which one row is
    gathered per token. A tied head is the embedding, read once in full as the head.
    """
    total = sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(params))
    if params.lm_head is not None:
        total -= int(params.embed.nbytes) - int(params.embed[0].nbytes)
    return total


def _versions(names: Sequence[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _caches() -> dict[str, str]:
    """Cache sizes of CPU 0 by level/type, e.g. {"L3": "266240K"} (Linux sysfs)."""
    out = {}
    for d in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            kind = (d / "type").read_text().strip()
            key = f"L{(d / 'level').read_text().strip()}" + ("i" if kind == "Instruction" else
                                                            "d" if kind == "Data" else "")
            out[key] = (d / "size").read_text().strip()
        except OSError:
            continue
    return out


def machine_info() -> dict[str, Any]:
    """CPU, memory, library versions and JAX backend: what a figure depends on."""
    mem_gb = None
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError):
        pass
    return {
        "cpu_model": _cpu_model(), "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "caches": _caches(), "mem_gb": mem_gb, "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": _versions(["jax", "jaxlib", "numpy", "torch", "transformers", "specjax"]),
        "jax_backend": jax.default_backend(), "class": machine_class(),
        "jax_devices": [str(d) for d in jax.devices()],
        "xla_flags": os.environ.get("XLA_FLAGS"),
    }


def jsonable(x: Any) -> Any:
    """NaN/inf become null so the file is strict JSON; numpy scalars become Python ones."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Path):
        return str(x)
    return x


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def pooled_difference(a: Sequence[np.ndarray], b: Sequence[np.ndarray], *,
                      draws: int = 10_000, seed: int = 0) -> dict[str, Any]:
    """Pooled hit rate of ``a`` minus that of ``b`` over the same positions, with a 95%
    interval from resampling whole prompts.

    ``a[i]`` and ``b[i]`` are [n_i] bool arrays over prompt i's positions (e.g. first-draft
    hits of two drafters on the same answer), or float ones of expected hits. Positions of
    one answer are not independent (an easy answer is easy for both), so the bootstrap
    draws prompts, not positions, and pairs them, which removes the prompt-to-prompt spread
    from the difference."""
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b, strict=False)):
        raise ValueError("a and b must score the same positions of the same prompts")
    n = np.array([len(x) for x in a], np.float64)
    if n.sum() == 0:
        raise ValueError("no positions to compare")
    d = np.array([x.sum() - y.sum() for x, y in zip(a, b, strict=True)], np.float64)
    diff, ci = ratio_of_sums(d, n, draws=draws, seed=seed)
    return {"diff": diff, "ci95": ci, "prompts": len(n), "positions": int(n.sum())}


def paired_speedup(base: Sequence[dict[str, Any]],
                   runs: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Speed of ``runs`` relative to ``base`` over the same prompts (one record each, with
    ``decode_s`` and ``new_tokens``: a B=1 generate call's), and its 95% interval resampling
    whole prompts, paired (a prompt's speed varies by tens of percent for both alike); None
    with fewer than two prompts that decoded.

    Each prompt's base time is scaled to the run's decoded tokens (the first new token comes
    from the prefill), so the ratio of summed times is the pooled speedup; the counts are
    equal where greedy output matched, or where sampling ran to the budget.

    Returns:
      ``{"ratio": float, "ci95": [lo, hi]}``; above 1 means ``runs`` decoded faster.
    """
    if len(base) != len(runs):
        raise ValueError("base and runs must hold the same prompts")
    pairs = [(b, r) for b, r in zip(base, runs, strict=True)
             if b["new_tokens"] > 1 and r["new_tokens"] > 1]
    if len(pairs) < 2:
        return None
    run_s = np.array([r["decode_s"] for _, r in pairs])
    base_s = np.array([b["decode_s"] * (r["new_tokens"] - 1) / (b["new_tokens"] - 1)
                       for b, r in pairs])
    ratio, ci = ratio_of_sums(base_s, run_s)
    return {"ratio": ratio, "ci95": ci}


def ratio_of_sums(num: np.ndarray, den: np.ndarray, *, draws: int = 10_000,
                  seed: int = 0) -> tuple[float, list[float]]:
    """sum(num) / sum(den) over prompts ([P] each, paired), and its 95% interval from
    resampling whole prompts. A draw whose ``den`` sums to 0 (only empty answers) is left
    out of the interval."""
    pick = np.random.default_rng(seed).integers(0, len(num), (draws, len(num)))
    with np.errstate(invalid="ignore", divide="ignore"):
        boot = num[pick].sum(1) / den[pick].sum(1)
    lo, hi = np.nanpercentile(np.where(np.isfinite(boot), boot, np.nan), [2.5, 97.5])
    return float(num.sum() / den.sum()), [float(lo), float(hi)]


def write_json(path: Path, result: dict[str, Any]) -> Path:
    """Write ``result`` as indented JSON (atomically), creating parent folders."""
    from specjax.checkpoint import atomic_write_bytes

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(jsonable(result), indent=1) + "\n").encode())
    return path


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (benchmarks run without a display)."""
    import matplotlib

    matplotlib.use("Agg")  # must precede pyplot's first import
    import matplotlib.pyplot as plt

    return plt


def check_sampling(temperature: float, top_p: float = 1.0) -> None:
    """Refuse a benchmark's sampling settings before any model loads: a negative or NaN
    temperature, a top_p outside (0, 1], or a filter on greedy decoding (nothing to filter).
    """
    if not temperature >= 0:  # also refuses NaN
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1 or (top_p < 1 and temperature == 0):
        raise ValueError(f"top_p is in (0, 1] and filters sampled draws (--temperature > 0), "
                         f"got {top_p} at temperature {temperature}")


def sampling_label(conf: dict[str, Any]) -> str:
    """A sampled run's temperature, with its top-p filter where one was on ("1, top-p 0.9";
    a config without ``top_p``, as older results and unfiltered batch runs hold, has none)."""
    top_p = conf.get("top_p", 1.0)
    return f"{conf['temperature']:g}" + (f", top-p {top_p:g}" if top_p < 1 else "")


def dash(x: float | None, fmt: str = ".2f") -> str:
    """``x`` formatted for a summary table, or ``-`` where it was not measured."""
    return "-" if x is None else format(x, fmt)


def save_figure(fig: Any, path: Path, dpi: int = 110) -> Path:
    """Lay out, write (creating parent folders) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def bar_plot(path: Path, series: dict[str, Sequence[float | None]], labels: Sequence[str], *,
             title: str, ylabel: str, hline: tuple[float, str] | None = None) -> Path:
    """Grouped bars (one group per label, one bar per series) with an optional line.

    A ``None`` value leaves its bar out (e.g. a figure that was not measured).
    """
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.8 / max(1, len(series))
    xs = np.arange(len(labels))
    for i, (name, values) in enumerate(series.items()):
        vals = [np.nan if v is None else v for v in values]
        bars = ax.bar(xs + (i - (len(series) - 1) / 2) * width, vals, width, label=name)
        ax.bar_label(bars, labels=["" if v is None else f"{v:.1f}" for v in values],
                     fontsize=8, padding=2)
    if hline is not None:
        ax.axhline(hline[0], color="k", linestyle="--", linewidth=1, label=hline[1])
    ax.set_xticks(xs, labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return save_figure(fig, path, dpi=120)


def int_list(text: str) -> tuple[int, ...]:
    """An argparse type: ``"1,2,4"`` -> (1, 2, 4)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def as_command(run_from_args: Callable[[argparse.Namespace], Any]
               ) -> Callable[[argparse.Namespace], int]:
    """A benchmark's ``run_*_from_args`` as a ``specjax bench`` command's ``args.run``.

    The command turns the persistent compilation cache on first (a second run of the same
    shapes compiles nothing) and returns exit code 0: a benchmark reports through its
    JSON, plot and printed summary, and refuses bad input by raising, so a run that
    returns has succeeded.
    """
    def run(args: argparse.Namespace) -> int:
        from specjax.compile_cache import enable_compilation_cache

        enable_compilation_cache()
        run_from_args(args)
        return 0

    return run


def generation_record(res: Any, compiles: int) -> dict[str, Any]:
    """What one timed B=1 :func:`specjax.generate` call contributes to a benchmark record:
    tokens and timings, and for speculative runs MAL, accept lengths and tree size."""
    s = res.stats
    rec = {"tokens": res.tokens[0], "new_tokens": s["new_tokens"], "prefill_s": s["prefill_s"],
           "decode_s": s["decode_s"], "wall_s": s["wall_s"],
           "decode_tokens_per_s": s["decode_tokens_per_s"], "tokens_per_s": s["tokens_per_s"],
           "compiles_while_timed": compiles}
    if "mean_accepted_length" in s:
        acc = s["accept_lengths"][0]
        rec |= {"mal": s["mean_accepted_length"], "target_forwards": s["target_forwards"],
                "accepted_tokens": int(sum(acc)), "accept_lengths": acc,
                "mean_tree_size": s["mean_tree_size"],
                "drafter_calls": s.get("mean_drafter_calls")}
    if s.get("draft_s") is not None:
        rec |= {"draft_s": s["draft_s"], "verify_s": s["verify_s"]}
    return rec
