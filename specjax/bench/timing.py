"""Timing helpers shared by the benchmarks: timed calls, compile counts, the target's
forward-latency curve.

Every figure is the best (and median) of several calls after an untimed compile call: on a
shared machine the best is the least disturbed by other load, so decisions read it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from tqdm import tqdm

from specjax.loaded import Target
from specjax.loop import bucket
from specjax.model import KVCache, Params, forward_hidden, init_cache, lm_head
from specjax.sampling import first_argmax
from specjax.speculative import cache_capacity

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def cache_geometry(prompt_len: int, max_new_tokens: int, spare: int) -> tuple[int, int]:
    """(context, capacity) of a representative decode step.

    context: committed cache rows midway through generation; capacity: rows allocated as
    :func:`specjax.generate` does (bucketed prompt + bucketed output + tree spare). Attention
    runs over the whole capacity (masked), so capacity is what sets its cost.
    """
    return prompt_len + max_new_tokens // 2, cache_capacity(prompt_len, max_new_tokens, None,
                                                            spare=spare)


def warmup_tokens(max_new_tokens: int) -> int:
    """The fewest new tokens (but 2) that land in ``max_new_tokens``' output bucket.

    Limits are arrays and shapes are bucketed, so a call with this budget compiles exactly
    the programs the timed call runs, at about half its cost. At least 2 tokens (when the
    budget allows): with 1 the prefill's token ends the call before eager mode has run,
    and so compiled, a single step.
    """
    b = bucket(max_new_tokens)
    return min(max_new_tokens, 2) if b == bucket(1) else b // 2 + 1


def ensure_warm(warm: set, key: Any, warmup: Callable[[], Any]) -> None:
    """Run ``warmup`` (an untimed call that compiles ``key``'s programs) unless ``key`` is in
    ``warm``, then add it.

    ``specjax.generate`` drops every compiled program when the process nears Linux's memory
    map limit (:func:`specjax.compile_cache.release_programs_near_map_limit`), and a warm
    key's next timed call would then compile inside the timing. So the check runs here
    first, where a drop makes every key cold again, and again after a warm-up, whose own
    programs a drop then took too (it runs once more).
    """
    from specjax.compile_cache import release_programs_near_map_limit

    if release_programs_near_map_limit():
        warm.clear()
    if key in warm:
        return
    warmup()
    if release_programs_near_map_limit():
        warm.clear()
        warmup()
    warm.add(key)


def time_calls(fn: Callable[[], Any], runs: int) -> dict[str, float]:
    """``fn`` once untimed (compile), then ``runs`` timed calls: best and median, in ms.

    The best is the least disturbed by other load on a shared machine; decisions use it.
    """
    jax.block_until_ready(fn())
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return {"best_ms": 1e3 * min(times), "median_ms": 1e3 * float(np.median(times)),
            "runs": runs}


@contextlib.contextmanager
def count_compiles() -> Iterator[list[int]]:
    """Count XLA backend compilations inside the block (``[n]``, read after it)."""
    n = [0]

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event == _COMPILE_EVENT:
            n[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield n
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _verify_forward(params: Params, cfg, tokens: Array, positions: Array,
                    cache: KVCache) -> tuple[Array, KVCache]:
    """Greedy verify pass of T tokens: [1, T] -> argmax [1, T] and the written cache.

    The cache is donated and threaded through like the decode loop's state, so its K/V
    rows are written in place instead of copying every layer's buffer each call.
    """
    hidden, cache, _ = forward_hidden(params, cfg, tokens, positions, cache)
    return first_argmax(lm_head(params, hidden)), cache  # verify_greedy's argmax


def verify_call(target: Target, num_tokens: int, *, context: int,
                capacity: int) -> Callable[[], Array]:
    """A closure running one target forward (+ full-vocabulary head) over ``num_tokens``.

    B=1, the ``context`` committed rows of a ``capacity``-row cache (K/V values are zeros:
    the cost does not depend on them); the cache is threaded from call to call.
    """
    cfg = target.cfg
    if context + num_tokens > capacity:
        raise ValueError(f"context {context} + {num_tokens} tokens exceeds capacity {capacity}")
    cache = init_cache(cfg, 1, capacity, target.params.embed.dtype)
    cache = dataclasses.replace(cache, lengths=jnp.full((1,), context, jnp.int32))
    tokens = jnp.asarray((np.arange(num_tokens)[None] * 7919 + 11) % cfg.vocab_size, jnp.int32)
    positions = jnp.asarray(context + np.arange(num_tokens)[None], jnp.int32)
    state = {"cache": cache}

    def call() -> Array:
        out, state["cache"] = _verify_forward(target.params, cfg, tokens, positions,
                                              state["cache"])
        return out

    return call


def verify_latency(target: Target, num_tokens: int, *, context: int, capacity: int,
                   runs: int) -> dict[str, float]:
    """:func:`time_calls` of :func:`verify_call`."""
    return time_calls(verify_call(target, num_tokens, context=context, capacity=capacity),
                      runs)


def monotone_fit(values: Sequence[float]) -> list[float]:
    """The least-squares non-decreasing fit (isotonic regression, pool adjacent violators).

    A forward over more tokens does no less work, so a latency that drops as T grows is
    other load on the machine; the tree choice reads this fit, not the raw points.
    """
    blocks: list[list[float]] = []  # [sum, count] of pooled runs
    for v in values:
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
    return [total / n for total, n in blocks for _ in range(int(n))]


def latency_curve(target: Target, sizes: Sequence[int], *, context: int, capacity: int,
                  runs: int, bar: tqdm | None = None) -> dict[str, Any]:
    """Forward latency for each T in ``sizes``: best and median of ``runs`` (ms), and the
    monotone fit of the best (:func:`monotone_fit`), which estimates read.

    Every size is compiled first; then each of ``runs`` rounds times every size once, so
    a burst of other load spreads over all sizes instead of skewing one.
    """
    calls = {}
    for t in sizes:
        if bar is not None:
            bar.set_description(f"latency T={t} (compile)")
        calls[t] = verify_call(target, t, context=context, capacity=capacity)
        jax.block_until_ready(calls[t]())
        if bar is not None:
            bar.update()
    times: dict[int, list[float]] = {t: [] for t in sizes}
    if bar is not None:
        bar.set_description("latency curve")
    for _ in range(runs):
        for t, call in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            times[t].append(1e3 * (time.perf_counter() - t0))
    best = [min(times[t]) for t in sizes]
    return {"context": context, "capacity": capacity, "batch": 1, "sizes": [int(t) for t in sizes],
            "best_ms": best, "median_ms": [float(np.median(times[t])) for t in sizes],
            "fit_ms": monotone_fit(best), "runs": runs,
            "what": "jitted forward_hidden + lm_head + argmax, B=1, causal block"}


def interp_latency(curve: dict[str, Any], num_tokens: int) -> float:
    """Latency (ms) at ``num_tokens`` from the monotone fit, linear between measured sizes."""
    sizes = curve["sizes"]
    if not sizes[0] <= num_tokens <= sizes[-1]:
        raise ValueError(f"T={num_tokens} is outside the measured sizes {sizes}")
    return float(np.interp(num_tokens, sizes, curve["fit_ms"]))
