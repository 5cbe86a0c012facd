"""``specjax bench spec``: Spec-Bench-style evaluation of speculative decoding on this machine.

One command, one run, one JSON + one PNG:

1. **Tree budget from measured latency.** A verify forward over T tokens costs little more
   than one over a single token only while the matrix products stay bandwidth bound; on a
   2-core CPU that stops early (DESIGN.md: a 60-token tree costs ~170 ms, a token ~24 ms).
   So the run measures the target's forward latency (jitted ``forward_hidden`` +
   ``lm_head`` + argmax, B=1, a cache as long as the evaluation's) for T = 1..32 tokens,
   measures the drafter's whole draft phase for each candidate tree of a small grid, takes
   each tree's MAL from a short calibration run on questions outside the evaluation set,
   and picks the tree maximising ``MAL / (verify_latency(T) + draft_time)``.
2. **Evaluation** on a deterministic Spec-Bench subset (the first ``per_task`` questions of
   each task, first turn, chat template, greedy, batch 1): vanilla decoding, speculative
   compiled and, for the first ``eager_per_task`` prompts of each task, speculative eager.
   Every shape bucket is compiled by an untimed warm-up call first. Speculative tokens are
   compared with vanilla tokens for every prompt (greedy decoding is lossless, so they
   must agree; a mismatch is reported loudly, with its first differing position, and does
   not stop the run).
3. **Report** per task and overall: MAL, decode tokens/s of vanilla and speculative
   decoding, speedup (same run, same prompts), compiled-vs-eager speedup, prompts matched.

MAL (mean accepted length) is counted the way Spec-Bench and EAGLE count it: tokens
committed per target forward, **the target's bonus token included** (so MAL >= 1; a
useless drafter gives 1.0).

Per-prompt results are appended to ``<out stem>.partial.jsonl`` as they finish, and a
restarted run with the same configuration skips them (and reuses the tree selection).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from tqdm import tqdm

import specjax
from specjax.api import Drafter, Target, encode_prompts
from specjax.bench.common import jsonable, machine_info, save_figure, write_json
from specjax.decode import bucket
from specjax.drafter import init_drafter_cache
from specjax.model import KVCache, Params, forward_hidden, init_cache, lm_head
from specjax.sampling import SamplingConfig
from specjax.speculative import Engine, SpecState, TreeSpec, draft_phase_jit
from specjax.vocab.head import VocabHead, full_head
from specjax.vocab.resolve import resolve_head

MT_BENCH_CATEGORIES = frozenset({"writing", "roleplay", "reasoning", "math", "coding",
                                 "extraction", "stem", "humanities"})
TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
# Calibration uses short-prompt tasks only: each config compiles once per prompt bucket,
# and summarization / rag prompts (~700-1600 tokens) would add a 1024-2048 bucket per config.
CALIB_TASKS = ("mt_bench", "translation", "qa", "math_reasoning")
LATENCY_SIZES = (1, 2, 4, 8, 12, 16, 24, 32)
# Trees with T = num_nodes <= 32 (T + 1 <= 32 draft tokens + root): on a 2-core CPU a larger
# verify costs several decode steps, so bigger trees cannot pay off.
DEFAULT_GRID = (
    TreeSpec("chain", depth=2), TreeSpec("chain", depth=3), TreeSpec("chain", depth=4),
    TreeSpec("chain", depth=5),
    TreeSpec("eagle2", depth=3, top_k=3, total_tokens=6),
    TreeSpec("eagle2", depth=4, top_k=4, total_tokens=8),
    TreeSpec("eagle2", depth=4, top_k=4, total_tokens=12),
    TreeSpec("eagle2", depth=5, top_k=4, total_tokens=16),
    TreeSpec("eagle2", depth=6, top_k=6, total_tokens=24),
)
MAL_NOTE = ("MAL = tokens committed per target forward, the target's bonus token included "
            "(Spec-Bench / EAGLE convention; 1.0 means no draft token was ever accepted)")
QUESTIONS_ENV = "SPECJAX_SPEC_BENCH"
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


# --------------------------------------------------------------------------------------
# Questions
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Question:
    """One Spec-Bench question (its first turn only)."""

    question_id: int
    task: str  # "mt_bench" for MT-bench's 8 categories, else the category
    category: str
    text: str


def resolve_questions(path: str | Path | None = None) -> Path:
    """The Spec-Bench ``question.jsonl``: ``path``, else ``$SPECJAX_SPEC_BENCH``, else
    ``../shared/data/spec_bench/question.jsonl`` relative to the repository root.

    Raises:
      FileNotFoundError: naming every place looked at.
    """
    if path is not None:
        tried = [Path(path)]
    elif os.environ.get(QUESTIONS_ENV):
        tried = [Path(os.environ[QUESTIONS_ENV])]
    else:
        root = Path(specjax.__file__).resolve().parent.parent
        tried = [root.parent / "shared" / "data" / "spec_bench" / "question.jsonl"]
    for p in tried:
        if p.is_file():
            return p
    raise FileNotFoundError(
        f"Spec-Bench questions not found at {', '.join(map(str, tried))}; pass --questions "
        f"PATH or set ${QUESTIONS_ENV} to hemingkx/Spec-Bench's data/spec_bench/question.jsonl")


def load_questions(path: Path) -> list[Question]:
    """Every question of a Spec-Bench ``question.jsonl``, in file order."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            cat = q["category"]
            out.append(Question(int(q["question_id"]),
                                "mt_bench" if cat in MT_BENCH_CATEGORIES else cat, cat,
                                q["turns"][0]))
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a Spec-Bench question ({e!r})") from None
    return out


def select_questions(questions: Sequence[Question], tasks: Sequence[str], per_task: int,
                     *, last: bool = False,
                     exclude: frozenset[int] = frozenset()) -> list[Question]:
    """The first (or ``last``) ``per_task`` questions of each task, grouped by task."""
    out = []
    for task in tasks:
        pool = [q for q in questions if q.task == task and q.question_id not in exclude]
        if not pool:
            known = sorted({q.task for q in questions})
            raise ValueError(f"no questions for task {task!r}; tasks are {known}")
        out += pool[-per_task:] if last else pool[:per_task]
    return out


# --------------------------------------------------------------------------------------
# Drafter, geometry, timing helpers
# --------------------------------------------------------------------------------------


def random_drafter(target: Target, seed: int = 0) -> Drafter:
    """An untrained EAGLE drafter (layer initialised from the target's last): MAL ~ 1.

    Only for checking the pipeline; its figures say nothing about speculative decoding.
    """
    from flax import nnx

    from specjax.drafter import DrafterConfig, EagleDrafter

    m = EagleDrafter(DrafterConfig(target.cfg), rngs=nnx.Rngs(seed),
                     init_layer=target.params.layers[-1])
    dtype = target.params.embed.dtype
    params = jax.tree.map(lambda a: a.astype(dtype), m.params())
    return Drafter(cfg=m.cfg, params=params, meta={"random": True, "seed": seed})


def resolve_drafter(drafter_dir: str | Path | None, target: Target) -> tuple[Drafter, str]:
    """(drafter, name) for ``drafter_dir``: a folder, None for the shipped one, "random"."""
    if drafter_dir is not None and str(drafter_dir) == "none":
        raise ValueError("this benchmark compares speculative with vanilla decoding and needs "
                         "a drafter: pass --drafter PATH (or 'random' to check the pipeline)")
    if drafter_dir is not None and str(drafter_dir) == "random":
        return random_drafter(target), "random"
    from specjax.defaults import default_drafter_dir

    path = Path(drafter_dir) if drafter_dir is not None else default_drafter_dir()
    return specjax.load_drafter(path, target), str(path)


def cache_geometry(prompt_len: int, max_new_tokens: int, spare: int) -> tuple[int, int]:
    """(context, capacity) of a representative decode step.

    context: committed cache rows midway through generation; capacity: rows allocated as
    :func:`specjax.generate` does (bucketed prompt + bucketed output + tree spare). Attention
    runs over the whole capacity (masked), so capacity is what sets its cost.
    """
    return prompt_len + max_new_tokens // 2, bucket(prompt_len) + bucket(max_new_tokens) + spare


def tree_spare(tree: TreeSpec) -> int:
    """Cache rows :func:`specjax.generate` reserves past the output for one tree step."""
    return max(tree.num_nodes, tree.workspace, tree.max_depth + 1)


def generate_capacity(prompt_len: int, max_new_tokens: int, tree: TreeSpec) -> int:
    """The cache capacity :func:`specjax.generate` allocates (so shapes, and compiled
    programs, are shared with real runs)."""
    return bucket(prompt_len) + bucket(max_new_tokens) + tree_spare(tree)


def warmup_tokens(max_new_tokens: int) -> int:
    """The fewest new tokens (but 2) that land in ``max_new_tokens``' output bucket.

    Limits are arrays and shapes are bucketed, so a call with this budget compiles exactly
    the programs the timed call runs, at about half its cost. At least 2 tokens (when the
    budget allows): with 1 the prefill's token ends the call before eager mode has run,
    and so compiled, a single step.
    """
    b = bucket(max_new_tokens)
    return min(max_new_tokens, 2) if b == bucket(1) else b // 2 + 1


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
    return jnp.argmax(lm_head(params, hidden), axis=-1), cache


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


def random_features(shape: tuple[int, ...], dtype: Any, seed: int = 0) -> Array:
    """Unit-scale Gaussian features made in numpy (no compile for a throwaway array)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def synthetic_state(target: Target, drafter: Drafter, *, context: int, capacity: int,
                    out_len: int, seed: int = 0) -> SpecState:
    """A B=1 :class:`SpecState` as it stands after ``context`` committed tokens.

    Both caches have ``context`` rows committed (zeros: costs do not depend on values) in a
    ``capacity``-row buffer; the root feature is random. Shapes and dtypes are those of
    :func:`specjax.speculative.spec_prefill`'s state for the same capacity and ``out_len``,
    so the draft phase compiled here is the one eager generation runs. For timing only.
    """
    dtype = target.params.embed.dtype
    lengths = jnp.full((1,), context, jnp.int32)
    tcache = dataclasses.replace(init_cache(target.cfg, 1, capacity, dtype), lengths=lengths)
    dcache = dataclasses.replace(init_drafter_cache(drafter.cfg, 1, capacity, dtype),
                                 lengths=lengths)
    return SpecState(
        tcache=tcache, dcache=dcache, root=jnp.full((1,), 11 % target.cfg.vocab_size, jnp.int32),
        root_feat=random_features((1, target.cfg.hidden_size), dtype, seed),
        out=jnp.zeros((1, out_len), jnp.int32), num_new=jnp.ones((1,), jnp.int32),
        done=jnp.zeros((1,), bool), accept_lens=jnp.zeros((1, out_len), jnp.int32),
        steps=jnp.zeros((1,), jnp.int32), shortlist_size=jnp.zeros((1,), jnp.float32),
        shortlist_hits=jnp.zeros((1,), jnp.int32), key=jax.random.PRNGKey(seed),
        max_new=jnp.int32(out_len))


def greedy_engine(target: Target, drafter: Drafter, tree: TreeSpec) -> Engine:
    """The static engine :func:`specjax.generate` builds for greedy decoding."""
    return Engine(cfg=target.cfg, dcfg=drafter.cfg, tree=tree,
                  sampling=SamplingConfig(temperature=0.0).static())


def draft_latency(target: Target, drafter: Drafter, tree: TreeSpec, *, context: int,
                  capacity: int, out_len: int, runs: int,
                  head: VocabHead | None = None) -> dict[str, float]:
    """Latency of the jitted greedy draft phase (tree build with the drafter), B=1.

    ``head``: the vocabulary head (default: the full vocabulary).
    ``context`` committed rows of a ``capacity``-row cache; ``out_len``: the output buffer.
    """
    state = synthetic_state(target, drafter, context=context, capacity=capacity,
                            out_len=out_len)
    eng = greedy_engine(target, drafter, tree)
    temperature = jnp.float32(0.0)
    head = head or full_head(target.cfg.vocab_size)
    return time_calls(lambda: draft_phase_jit(target.params, drafter.params, head, state,
                                              temperature, eng=eng), runs)


def tree_dict(tree: TreeSpec) -> dict[str, Any]:
    """A tree's fields plus its node count T (root included), for JSON."""
    d = dataclasses.asdict(tree)
    d["num_nodes"] = tree.num_nodes
    if tree.kind != "eagle2":
        d.pop("top_k"), d.pop("total_tokens")
    if tree.kind != "static":
        d.pop("paths")
    return d


def tree_label(tree: TreeSpec) -> str:
    """Short name: ``chain d4`` or ``eagle2 d4 k4 n12``."""
    if tree.kind == "chain":
        return f"chain d{tree.depth}"
    if tree.kind == "eagle2":
        return f"eagle2 d{tree.depth} k{tree.top_k} n{tree.total_tokens}"
    return f"static n{tree.num_nodes - 1}"


# --------------------------------------------------------------------------------------
# Tree selection
# --------------------------------------------------------------------------------------


def select_tree(target: Target, drafter: Drafter, grid: Sequence[TreeSpec],
                calib_ids: Sequence[list[int]], curve: dict[str, Any], *, prompt_len: int,
                max_new_tokens: int, calib_max_new_tokens: int, stop_on_eos: bool, runs: int,
                head: VocabHead | None = None, bar: tqdm | None = None) -> dict[str, Any]:
    """Estimate each tree's decode speed and pick the fastest.

    speed = MAL / (verify_latency(T) + draft_time), with MAL from one batched greedy run
    over the calibration prompts (MAL is per row, so batching does not change it and
    costs one compile per tree), verify latency read off ``curve`` and draft time
    measured on the jitted draft phase, with the cache that generating ``max_new_tokens``
    from a ``prompt_len``-token prompt allocates for that tree. Vanilla decoding is
    estimated as 1 / latency(1). ``head`` is the drafter's vocabulary head (default full).
    """
    head = head or full_head(target.cfg.vocab_size)
    ctx = curve["context"]
    vanilla_ms = interp_latency(curve, 1)
    rows = []
    for tree in grid:
        if bar is not None:
            bar.set_description(f"calibrate {tree_label(tree)}")
        res = specjax.generate(target, [list(p) for p in calib_ids],
                               max_new_tokens=calib_max_new_tokens, stop_on_eos=stop_on_eos,
                               drafter=drafter, tree=tree, vocab=head)
        draft = draft_latency(target, drafter, tree, context=ctx,
                              capacity=generate_capacity(prompt_len, max_new_tokens, tree),
                              out_len=bucket(max_new_tokens), runs=runs, head=head)
        verify_ms = interp_latency(curve, tree.num_nodes)
        mal = res.stats["mean_accepted_length"]
        step_ms = verify_ms + draft["best_ms"]
        rows.append({"label": tree_label(tree), "tree": tree_dict(tree), "mal": mal,
                     "calib_target_forwards": res.stats["target_forwards"],
                     "draft_ms": draft["best_ms"], "draft_median_ms": draft["median_ms"],
                     "verify_ms": verify_ms, "step_ms": step_ms,
                     "est_tokens_per_s": 1e3 * mal / step_ms,
                     "est_speedup": mal * vanilla_ms / step_ms})
        if bar is not None:
            bar.update()
    best = max(range(len(rows)), key=lambda i: rows[i]["est_tokens_per_s"])
    return {"grid": rows, "chosen_index": best, "chosen": rows[best],
            "vanilla_est_tokens_per_s": 1e3 / vanilla_ms,
            "formula": "est_tokens_per_s = MAL / (verify_latency(T = num_nodes) + draft_time); "
                       "est_speedup = that * latency(1); latencies from the monotone fit",
            "mal_note": MAL_NOTE}


# --------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _method_record(res: specjax.GenerationResult, compiles: int) -> dict[str, Any]:
    s = res.stats
    rec = {"tokens": res.tokens[0], "new_tokens": s["new_tokens"], "prefill_s": s["prefill_s"],
           "decode_s": s["decode_s"], "wall_s": s["wall_s"],
           "decode_tokens_per_s": s["decode_tokens_per_s"], "tokens_per_s": s["tokens_per_s"],
           "compiles_while_timed": compiles}
    if "mean_accepted_length" in s:
        acc = s["accept_lengths"][0]
        rec |= {"mal": s["mean_accepted_length"], "target_forwards": s["target_forwards"],
                "accepted_tokens": int(sum(acc)), "accept_lengths": acc}
    if s.get("draft_s") is not None:
        rec |= {"draft_s": s["draft_s"], "verify_s": s["verify_s"]}
    return rec


class _Runner:
    """Runs one method on one prompt, warming each (method, prompt bucket) up first."""

    def __init__(self, target: Target, drafter: Drafter, tree: TreeSpec, max_new_tokens: int,
                 stop_on_eos: bool, head: VocabHead):
        self.target, self.drafter, self.tree, self.head = target, drafter, tree, head
        self.max_new_tokens, self.stop_on_eos = max_new_tokens, stop_on_eos
        self.warm: set[tuple[str, int]] = set()
        self.warmup_s = 0.0

    def __call__(self, method: str, ids: list[int]) -> dict[str, Any]:
        kw: dict[str, Any] = {"stop_on_eos": self.stop_on_eos}
        if method != "vanilla":
            kw |= {"drafter": self.drafter, "tree": self.tree, "vocab": self.head,
                   "mode": "eager" if method == "eager" else "compiled"}
        if (method, bucket(len(ids))) not in self.warm:
            t0 = time.perf_counter()
            specjax.generate(self.target, [ids], max_new_tokens=warmup_tokens(
                self.max_new_tokens), **kw)
            self.warmup_s += time.perf_counter() - t0
            self.warm.add((method, bucket(len(ids))))
        with count_compiles() as n:
            res = specjax.generate(self.target, [ids], max_new_tokens=self.max_new_tokens, **kw)
        return _method_record(res, n[0])


def _pool(recs: Sequence[dict[str, Any]], method: str) -> dict[str, float | None]:
    """Ratio-of-sums rates over the prompts that ran ``method``."""
    rs = [r[method] for r in recs if r.get(method)]
    if not rs:
        return {"decode_tokens_per_s": None, "tokens_per_s": None}
    dec_tokens = sum(r["new_tokens"] - 1 for r in rs)  # the first token comes from prefill
    dec_s = sum(r["decode_s"] for r in rs)
    return {"decode_tokens_per_s": dec_tokens / dec_s if dec_s > 0 else None,
            "tokens_per_s": sum(r["new_tokens"] for r in rs) / sum(r["wall_s"] for r in rs)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def aggregate(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Pooled figures of a group of prompt records.

    MAL pools every step: accepted tokens / target forwards (bonus included). Rates are
    ratios of sums (tokens / seconds), so long outputs weigh more than short ones.
    """
    spec = [r["spec"] for r in records]
    fwd = sum(s["target_forwards"] for s in spec)
    eager_recs = [r for r in records if r.get("eager")]
    v, s = _pool(records, "vanilla"), _pool(records, "spec")
    s_on_eager, e = _pool(eager_recs, "spec"), _pool(eager_recs, "eager")
    draft = sum(r["eager"]["draft_s"] for r in eager_recs)
    verify = sum(r["eager"]["verify_s"] for r in eager_recs)
    return {
        "prompts": len(records), "matched": sum(r["greedy_match"] for r in records),
        "mal": sum(x["accepted_tokens"] for x in spec) / fwd if fwd else None,
        "vanilla_decode_tokens_per_s": v["decode_tokens_per_s"],
        "spec_decode_tokens_per_s": s["decode_tokens_per_s"],
        "speedup": _ratio(s["decode_tokens_per_s"], v["decode_tokens_per_s"]),
        "e2e_speedup": _ratio(s["tokens_per_s"], v["tokens_per_s"]),
        "eager_prompts": len(eager_recs),
        "eager_matched": sum(r["eager_match"] for r in eager_recs),
        "eager_decode_tokens_per_s": e["decode_tokens_per_s"],
        "eager_speedup": _ratio(e["decode_tokens_per_s"],
                                _pool(eager_recs, "vanilla")["decode_tokens_per_s"]),
        "compiled_vs_eager": _ratio(s_on_eager["decode_tokens_per_s"], e["decode_tokens_per_s"]),
        "eager_draft_fraction": draft / (draft + verify) if draft + verify > 0 else None,
    }


# --------------------------------------------------------------------------------------
# Resumable partial results
# --------------------------------------------------------------------------------------


def partial_path(out: Path) -> Path:
    """``results/bench_spec.json`` -> ``results/bench_spec.partial.jsonl``."""
    return out.with_name(out.stem + ".partial.jsonl")


def _read_partial(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    recs = []
    for line in path.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by an interrupted write
    return recs


def _append(path: Path, rec: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(jsonable(rec)) + "\n")
        f.flush()


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------


def run_spec_bench(model_dir: str | Path, drafter_dir: str | Path | None, *, per_task: int = 4,
                   max_new_tokens: int = 128, tree: TreeSpec | None = None,
                   questions: str | Path | None = None,
                   out: str | Path = "results/bench_spec.json",
                   tasks: Sequence[str] = TASKS, eager_per_task: int = 1,
                   grid: Sequence[TreeSpec] = DEFAULT_GRID,
                   calib_tasks: Sequence[str] = CALIB_TASKS, calib_per_task: int = 1,
                   calib_max_new_tokens: int = 48,
                   latency_sizes: Sequence[int] = LATENCY_SIZES, runs: int = 7,
                   stop_on_eos: bool = True, dtype: str | None = None,
                   prompts: Sequence[dict[str, Any]] | None = None,
                   calib_prompts: Sequence[Sequence[int]] | None = None,
                   drafter: Drafter | None = None, resume: bool = True,
                   vocab: str | VocabHead = "full") -> dict[str, Any]:
    """Benchmark greedy speculative decoding on a Spec-Bench subset; write JSON + PNG.

    Args:
      model_dir: a converted target folder.
      drafter_dir: a drafter folder; None for the shipped one; "random" for an untrained
        drafter (pipeline check only).
      per_task: evaluation prompts per task: the first ``per_task`` of each task.
      max_new_tokens: budget per prompt (EOS also stops when ``stop_on_eos``).
      tree: a fixed draft tree; None chooses one from ``grid`` (see :func:`select_tree`).
        Either way the latency curve is measured and the tree's estimate is reported.
      questions: the Spec-Bench ``question.jsonl`` (see :func:`resolve_questions`).
      out: JSON path; the PNG goes next to it (``.png``), partial results to
        ``<stem>.partial.jsonl`` (removed once the JSON is written).
      tasks: which tasks to evaluate (default all six: mt_bench + Spec-Bench's five).
      eager_per_task: prompts per task also run in eager mode (slow).
      calib_tasks, calib_per_task, calib_max_new_tokens: the calibration prompts (the last
        ``calib_per_task`` questions of each calibration task, never evaluated) and budget.
      latency_sizes: T values of the latency curve (must cover every tree's node count).
      runs: timed repeats of each micro-benchmark (after one untimed compile call).
      prompts, calib_prompts: internal (tests): pre-tokenised evaluation prompts
        ``{"question_id", "task", "ids"}`` and calibration prompt ids, bypassing questions
        and the tokenizer.
      drafter: internal: an already loaded drafter (overrides ``drafter_dir``).
      resume: reuse matching records of an interrupted run's partial file.
      vocab: the drafter's vocabulary head spec ("full", "fr:8192", "dynaspec", ...; see
        :func:`specjax.vocab.resolve_head`), used for calibration, draft timing and
        evaluation. Verification is always over the full vocabulary.
    Returns:
      The dict written to ``out``.
    """
    if per_task < 1 or max_new_tokens < 1 or eager_per_task < 0:
        raise ValueError("need per_task >= 1, max_new_tokens >= 1 and eager_per_task >= 0")
    grid = (tree,) if tree is not None else tuple(grid)
    if not grid:
        raise ValueError("the tree grid is empty")
    sizes = sorted({int(t) for t in latency_sizes} | {1})
    if max(t.num_nodes for t in grid) > sizes[-1]:
        sizes.append(max(t.num_nodes for t in grid))  # never extrapolate the curve
    out = Path(out)
    t_start = time.perf_counter()
    load_start = os.getloadavg()

    target = specjax.load(model_dir, dtype)
    if drafter is not None:
        drafter_name = str(drafter.path) if drafter.path is not None else "in-memory"
    else:
        drafter, drafter_name = resolve_drafter(drafter_dir, target)
    head = resolve_head(vocab, target, drafter)

    # The prompts: Spec-Bench questions through the chat template, or given ids (tests).
    qpath = None
    if prompts is None:
        qpath = resolve_questions(questions)
        qs = load_questions(qpath)
        chosen = select_questions(qs, tasks, per_task)
        evals = [{"question_id": q.question_id, "task": q.task, "category": q.category,
                  "ids": encode_prompts(target, q.text, chat=True)[0]} for q in chosen]
        calib = select_questions(qs, calib_tasks, calib_per_task, last=True,
                                 exclude=frozenset(q.question_id for q in chosen))
        calib_qids = [q.question_id for q in calib]
        calib_ids = [encode_prompts(target, q.text, chat=True)[0] for q in calib]
    else:
        if calib_prompts is None:
            raise ValueError("pre-tokenised prompts need calib_prompts too")
        evals = [{"question_id": int(p["question_id"]), "task": p["task"],
                  "category": p.get("category", p["task"]), "ids": list(map(int, p["ids"]))}
                 for p in prompts]
        calib_qids, calib_ids = None, [list(map(int, p)) for p in calib_prompts]
    task_order = [t for t in dict.fromkeys(p["task"] for p in evals)]
    eager_qids = {p["question_id"] for t in task_order
                  for p in [q for q in evals if q["task"] == t][:eager_per_task]}

    mean_prompt = int(round(np.mean([len(p["ids"]) for p in evals])))
    # Spare rows for the largest write: a T-token forward or a tree's drafter workspace.
    spare = max(sizes[-1], *map(tree_spare, grid))
    context, capacity = cache_geometry(mean_prompt, max_new_tokens, spare)
    config = {
        "model": str(model_dir), "drafter": drafter_name, "dtype": str(target.params.embed.dtype),
        "per_task": per_task, "max_new_tokens": max_new_tokens, "tasks": task_order,
        "eager_per_task": eager_per_task, "greedy": True, "chat_template": prompts is None,
        "batch_size": 1, "stop_on_eos": stop_on_eos, "turns": "first turn only",
        "questions": None if qpath is None else str(qpath),
        "tree_mode": "given" if tree is not None else "auto",
        "grid": [tree_dict(t) for t in grid], "calib_tasks": list(calib_tasks),
        "calib_per_task": calib_per_task, "calib_question_ids": calib_qids,
        "calib_max_new_tokens": calib_max_new_tokens, "latency_sizes": sizes, "runs": runs,
        "latency_context": context, "latency_capacity": capacity,
        "vocab": vocab if isinstance(vocab, str) else repr(head),
    }

    # Resume: a selection and prompt records written under the same configuration.
    ppath = partial_path(out)
    old = _read_partial(ppath) if resume else []
    if not resume and ppath.exists():
        ppath.unlink()
    # A drafter retrained in place must not resume from the old one's records.
    manifest = None if drafter.path is None else Path(drafter.path) / "specjax.json"
    stamp = manifest.stat().st_mtime if manifest is not None and manifest.exists() else None
    sel_key = json.dumps(jsonable({k: v for k, v in config.items()
                                    if k not in ("per_task", "tasks", "eager_per_task")}
                                   | {"drafter_mtime": stamp}), sort_keys=True)
    selection = next((r["selection"] for r in old
                      if r.get("kind") == "selection" and r.get("key") == sel_key), None)
    n_steps = len(evals) + len(eager_qids) + (0 if selection else len(sizes) + len(grid))
    bar = tqdm(total=n_steps, unit="step")
    if selection is None:
        curve = latency_curve(target, sizes, context=context, capacity=capacity, runs=runs,
                              bar=bar)
        selection = select_tree(target, drafter, grid, calib_ids, curve,
                                prompt_len=mean_prompt, max_new_tokens=max_new_tokens,
                                calib_max_new_tokens=calib_max_new_tokens,
                                stop_on_eos=stop_on_eos, runs=runs, head=head, bar=bar)
        selection["latency"] = curve
        _append(ppath, {"kind": "selection", "key": sel_key, "selection": selection})
    else:
        tqdm.write(f"resuming: reusing the tree selection in {ppath}")
    chosen_tree = grid[selection["chosen_index"]]
    run_key = json.dumps({"sel": sel_key, "tree": tree_dict(chosen_tree)}, sort_keys=True)
    done = {r["question_id"]: r for r in old if r.get("kind") == "prompt"
            and r.get("key") == run_key and (r["eager"] is not None) == (
                r["question_id"] in eager_qids)}

    runner = _Runner(target, drafter, chosen_tree, max_new_tokens, stop_on_eos, head)
    records = []
    for p in evals:
        qid = p["question_id"]
        if qid in done:
            records.append(done[qid])
            bar.update(2 if qid in eager_qids else 1)
            continue
        bar.set_description(f"q{qid} {p['task']}")
        rec = {"kind": "prompt", "key": run_key, "question_id": qid, "task": p["task"],
               "category": p["category"], "prompt_tokens": len(p["ids"])}
        rec["vanilla"] = runner("vanilla", p["ids"])
        rec["spec"] = runner("spec", p["ids"])
        ref = rec["vanilla"]["tokens"]
        rec["first_mismatch"] = first_mismatch(rec["spec"]["tokens"], ref)
        rec["greedy_match"] = rec["first_mismatch"] is None
        bar.update()
        rec["eager"] = rec["eager_first_mismatch"] = rec["eager_match"] = None
        if qid in eager_qids:
            bar.set_description(f"q{qid} {p['task']} eager")
            rec["eager"] = runner("eager", p["ids"])
            rec["eager_first_mismatch"] = first_mismatch(rec["eager"]["tokens"], ref)
            rec["eager_match"] = rec["eager_first_mismatch"] is None
            bar.update()
        for name, pos in (("speculative", rec["first_mismatch"]),
                          ("eager speculative", rec["eager_first_mismatch"])):
            if pos is not None:
                tqdm.write(f"!!! GREEDY MISMATCH: question {qid} ({p['task']}): {name} output "
                           f"differs from vanilla at new token {pos} !!!")
        _append(ppath, rec)
        records.append(rec)
    bar.close()

    by_task = {t: aggregate([r for r in records if r["task"] == t]) for t in task_order}
    # Every shape was compiled by a warm-up; a compile inside a timed call means a cache
    # miss (a recompile) that inflated that call's time.
    timed_compiles = sum(r[m]["compiles_while_timed"] for r in records
                         for m in ("vanilla", "spec", "eager") if r.get(m))
    overall = aggregate(records)
    mismatches = [{"question_id": r["question_id"], "task": r["task"],
                   "first_mismatch": r["first_mismatch"],
                   "eager_first_mismatch": r["eager_first_mismatch"]}
                  for r in records if not r["greedy_match"] or r["eager_match"] is False]
    result = {
        "benchmark": "spec", "model_name": Path(model_dir).name, "config": config,
        "machine": machine_info() | {"loadavg_start": load_start,
                                     "loadavg_end": os.getloadavg()},
        "mal_note": MAL_NOTE, "mal_counts_bonus_token": True,
        "tree": tree_dict(chosen_tree), "tree_label": tree_label(chosen_tree),
        "latency": selection["latency"], "tree_selection": selection,
        "per_task": by_task, "overall": overall, "timed_compiles": timed_compiles,
        "greedy_equality": {"matched": overall["matched"], "prompts": len(records),
                            "all_match": not mismatches, "mismatches": mismatches},
        "prediction": {"est_tokens_per_s": selection["chosen"]["est_tokens_per_s"],
                       "realized_spec_decode_tokens_per_s": overall["spec_decode_tokens_per_s"],
                       "calibration_mal": selection["chosen"]["mal"],
                       "evaluation_mal": overall["mal"],
                       "est_speedup": selection["chosen"]["est_speedup"],
                       "realized_speedup": overall["speedup"]},
        "resumed_prompts": len([r for r in records if r["question_id"] in done]),
        "warmup_s": runner.warmup_s, "wall_s": time.perf_counter() - t_start,
        "per_prompt": [{k: v for k, v in r.items() if k not in ("kind", "key")}
                       for r in records],
    }
    write_json(out, result)
    plot_spec(result, out.with_suffix(".png"))
    ppath.unlink(missing_ok=True)
    print(summary(result))
    return result


# --------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------


def plot_spec(r: dict[str, Any], path: Path) -> Path:
    """Four panels: MAL per task, speedup per task, the latency curve, the tree grid."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot's import
    import matplotlib.pyplot as plt

    tasks = list(r["per_task"]) + ["overall"]
    rows = [r["per_task"][t] for t in tasks[:-1]] + [r["overall"]]
    nan = float("nan")

    def vals(key: str) -> list[float]:
        return [nan if x[key] is None else x[key] for x in rows]

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    xs = np.arange(len(tasks))
    ax = axes[0, 0]
    bars = ax.bar(xs, vals("mal"), color="tab:blue")
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.axhline(1.0, color="k", lw=0.8, ls=":")
    ax.set_xticks(xs, tasks, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("MAL (tokens / target forward)")
    ax.set_title("Mean accepted length per task (bonus token included)", fontsize=10)

    ax = axes[0, 1]
    w = 0.4
    b1 = ax.bar(xs - w / 2, vals("speedup"), w, label="speculative compiled / vanilla")
    b2 = ax.bar(xs + w / 2, vals("eager_speedup"), w, label="speculative eager / vanilla")
    for b in (b1, b2):
        ax.bar_label(b, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(xs, tasks, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("decode speedup (same run)")
    m = r["greedy_equality"]
    ax.set_title(f"Speedup per task; greedy equal {m['matched']}/{m['prompts']} prompts",
                 fontsize=10)
    ax.legend(fontsize=8)

    ax = axes[1, 0]
    lat = r["latency"]
    ax.plot(lat["sizes"], lat["best_ms"], "o", label=f"best of {lat['runs']}")
    ax.plot(lat["sizes"], lat["median_ms"], "x", alpha=0.6, label="median")
    ax.plot(lat["sizes"], lat["fit_ms"], "-", label="monotone fit (used for estimates)")
    t = r["tree"]["num_nodes"]
    ax.axvline(t, color="tab:red", ls=":", label=f"chosen tree T={t}")
    ax.set_xlabel("tokens per target forward (T)")
    ax.set_ylabel("ms")
    ax.set_title(f"Target forward latency, B=1, cache {lat['context']}/{lat['capacity']} rows",
                 fontsize=10)
    ax.legend(fontsize=8)

    ax = axes[1, 1]
    sel = r["tree_selection"]
    g = sel["grid"]
    gx = np.arange(len(g))
    colors = ["tab:red" if i == sel["chosen_index"] else "tab:gray" for i in gx]
    bars = ax.bar(gx, [row["est_tokens_per_s"] for row in g], color=colors)
    ax.bar_label(bars, labels=[f"{row['mal']:.2f}" for row in g], fontsize=7)
    ax.axhline(sel["vanilla_est_tokens_per_s"], color="k", ls="--", lw=1,
               label="vanilla est. 1/latency(1)")
    ax.set_xticks(gx, [row["label"] for row in g], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("estimated tokens/s")
    ax.set_title("Tree grid: MAL / (verify(T) + draft); bar labels = calibration MAL",
                 fontsize=10)
    ax.legend(fontsize=8)
    mach = r["machine"]
    fig.suptitle(f"{r['model_name']} + drafter {Path(r['config']['drafter']).name}, tree "
                 f"{r['tree_label']}, {r['config']['max_new_tokens']} greedy tokens, "
                 f"{mach['nproc']} CPUs ({mach['cpu_model']})", fontsize=10)
    return save_figure(fig, path)


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def summary(r: dict[str, Any]) -> str:
    """A human-readable table of one result."""
    sel = r["tree_selection"]
    lines = [f"{r['model_name']}, drafter {r['config']['drafter']} "
             f"(vocab {r['config'].get('vocab', 'full')}), "
             f"{r['config']['max_new_tokens']} greedy new tokens, batch 1",
             "latency (ms, best; monotone fit) " + ", ".join(
                 f"T={t}: {ms:.1f}" + ("" if abs(fit - ms) < 0.05 else f" ({fit:.1f})")
                 for t, ms, fit in zip(r["latency"]["sizes"], r["latency"]["best_ms"],
                                       r["latency"]["fit_ms"], strict=True)),
             f"{'tree':<24}{'T':>4}{'cal MAL':>9}{'draft ms':>10}{'verify ms':>10}"
             f"{'est tok/s':>10}{'est x':>7}"]
    for i, g in enumerate(sel["grid"]):
        lines.append(f"{g['label']:<24}{g['tree']['num_nodes']:>4}{g['mal']:>9.2f}"
                     f"{g['draft_ms']:>10.1f}{g['verify_ms']:>10.1f}{g['est_tokens_per_s']:>10.1f}"
                     f"{g['est_speedup']:>7.2f}" + ("  <- chosen" if i == sel["chosen_index"]
                                                    else ""))
    lines.append(f"chosen tree: {r['tree_label']} (vanilla est. "
                 f"{sel['vanilla_est_tokens_per_s']:.1f} tok/s)")
    lines.append(f"{'task':<16}{'n':>3}{'MAL*':>7}{'vanilla':>9}{'spec':>9}{'speedup':>9}"
                 f"{'eager':>9}{'comp/eag':>9}{'matched':>9}")
    for name, a in list(r["per_task"].items()) + [("overall", r["overall"])]:
        lines.append(f"{name:<16}{a['prompts']:>3}{_f(a['mal']):>7}"
                     f"{_f(a['vanilla_decode_tokens_per_s'], '.1f'):>9}"
                     f"{_f(a['spec_decode_tokens_per_s'], '.1f'):>9}{_f(a['speedup']):>9}"
                     f"{_f(a['eager_decode_tokens_per_s'], '.1f'):>9}"
                     f"{_f(a['compiled_vs_eager']):>9}{a['matched']:>5}/{a['prompts']:<3}")
    lines.append("* " + MAL_NOTE + "; rates are decode tokens/s")
    p = r["prediction"]
    lines.append(f"predicted {_f(p['est_tokens_per_s'], '.1f')} tok/s "
                 f"({_f(p['est_speedup'])}x, calibration MAL {_f(p['calibration_mal'])}); "
                 f"realized {_f(p['realized_spec_decode_tokens_per_s'], '.1f')} tok/s "
                 f"({_f(p['realized_speedup'])}x, MAL {_f(p['evaluation_mal'])})")
    if r["timed_compiles"]:
        lines.append(f"warning: {r['timed_compiles']} XLA compiles happened inside timed "
                     "calls (recompiles); those prompts' times include them")
    eq = r["greedy_equality"]
    if eq["all_match"]:
        lines.append(f"greedy equality: all {eq['prompts']} prompts match vanilla token for "
                     "token")
    else:
        lines.append(f"!!! greedy equality: {eq['matched']}/{eq['prompts']} prompts match; "
                     "mismatches (question, first differing new token): " + ", ".join(
                         f"q{m['question_id']}@{m['first_mismatch']}"
                         + (f" eager@{m['eager_first_mismatch']}"
                            if m["eager_first_mismatch"] is not None else "")
                         for m in eq["mismatches"]) + " !!!")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def add_tree_args(p: argparse.ArgumentParser, *, auto: bool) -> None:
    """``--tree`` (+ depth / top-k / tokens); ``auto`` adds the measured choice."""
    choices = ["auto", "eagle2", "chain"] if auto else ["eagle2", "chain"]
    p.add_argument("--tree", default=choices[0], choices=choices,
                   help="draft tree" + (": auto = chosen from the measured latency curve and "
                                        "a calibration run (default)" if auto else
                                        f" (default {choices[0]})"))
    d = TreeSpec()
    p.add_argument("--tree-depth", type=int, default=None,
                   help=f"draft levels (default {d.depth})")
    p.add_argument("--tree-top-k", type=int, default=None,
                   help=f"EAGLE-2 beam width (default {d.top_k})")
    p.add_argument("--tree-tokens", type=int, default=None,
                   help=f"EAGLE-2 draft tokens per step, root excluded (default "
                        f"{d.total_tokens})")


def tree_from_args(args: argparse.Namespace) -> TreeSpec | None:
    """The TreeSpec the flags name; None for ``--tree auto``."""
    given = [f for f in ("tree_depth", "tree_top_k", "tree_tokens")
             if getattr(args, f) is not None]
    if args.tree == "auto":
        if given:
            raise ValueError("--tree-depth/--tree-top-k/--tree-tokens need --tree eagle2|chain")
        return None
    d = TreeSpec()
    return TreeSpec(kind=args.tree,
                    depth=d.depth if args.tree_depth is None else args.tree_depth,
                    top_k=d.top_k if args.tree_top_k is None else args.tree_top_k,
                    total_tokens=d.total_tokens if args.tree_tokens is None
                    else args.tree_tokens)


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """Attach ``specjax bench spec``'s flags to a (sub)parser."""
    p.add_argument("--model", default=None,
                   help="converted target folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None,
                   help="drafter folder (default: the shipped drafter); 'random' = an "
                        "untrained drafter, to check the pipeline")
    p.add_argument("--per-task", type=int, default=4,
                   help="evaluation prompts per task: the first N of each (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    add_tree_args(p, auto=True)
    p.add_argument("--questions", default=None,
                   help=f"Spec-Bench question.jsonl (default: ${QUESTIONS_ENV}, else "
                        "../shared/data/spec_bench/question.jsonl from the repository root)")
    p.add_argument("--tasks", default=",".join(TASKS),
                   help=f"comma-separated tasks (default {','.join(TASKS)})")
    p.add_argument("--eager-per-task", type=int, default=1,
                   help="prompts per task also run in eager mode (default 1)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="cast parameters at load (default: as stored)")
    p.add_argument("--vocab", default="full",
                   help="drafter vocabulary head: full (default), fr:N, pafr:N, dynaspec, ...")
    p.add_argument("--no-resume", action="store_true",
                   help="ignore and remove the partial results of an interrupted run")
    p.add_argument("--out", default="results/bench_spec.json")


def run_spec_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Run :func:`run_spec_bench` from :func:`add_spec_args`'s flags."""
    if args.model is not None:
        model = Path(args.model)
    else:
        from specjax.defaults import ensure_default_target

        model = ensure_default_target()
    return run_spec_bench(model, args.drafter, per_task=args.per_task,
                          max_new_tokens=args.max_new_tokens, tree=tree_from_args(args),
                          questions=args.questions, out=Path(args.out),
                          tasks=[t for t in args.tasks.split(",") if t],
                          eager_per_task=args.eager_per_task, dtype=args.dtype,
                          resume=not args.no_resume, vocab=args.vocab)
