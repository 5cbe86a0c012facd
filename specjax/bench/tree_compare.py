"""``specjax bench trees``: draft-tree kinds compared at equal node budgets (issue 13).

On the Spec-Bench prompts of ``specjax bench spec`` (the same question selection, the same
calibration questions, never evaluated), for every temperature, budget T and tree kind:

* **Trees at budget T** (T = drafted nodes, the root excluded; the target verifies T + 1):

  - ``chain``: depth T.
  - ``static``: a fixed tree of T nodes grown greedily from a positional acceptance vector
    (:data:`RANK_ACCEPT`, the chance that the rank-r child of an accepted node is accepted;
    Sequoia's model of a drafter, here with assumed rather than measured numbers): the path
    of highest product is added until T nodes are listed. Small budgets give EAGLE-1-like
    trees, e.g. T=8 is ``(0) (1) (2) (3) (0,0) (0,1) (1,0) (0,0,0)``.
  - ``eagle2``: ``total_tokens = T``, depth and beam from :func:`eagle2_shape` (the
    ``bench spec`` grid's shapes: T=8 -> depth 4, top-k 4).
  - ``dyspec``: ``total_tokens = T`` (one drafter call per node).
  - ``dyspec-topk``: the same tree with ``topk_children``: when sampling, children in
    top-k order keyed by the chance of acceptance and the point-mass verification rule
    (EAGLE-2's), instead of children drawn without replacement and multi-draft rejection
    sampling. At temperature 0 it is ``dyspec``.
  - ``dyspec-threshold``: ``total_tokens = T`` (the cap), EAGLE-2's depth and beam at that
    budget as its depth and frontier cap (so a drafter call never has more rows than
    EAGLE-2's), and a threshold chosen per budget and temperature on the calibration
    prompts (:func:`choose_threshold`).

* **Threshold choice (Sequoia-style, per hardware and budget).** Each threshold of a small
  grid runs on the calibration prompts at cap T, one prompt at a time like the evaluation;
  the one with the highest calibration decode tokens/s wins (ties: the larger threshold).
  A step verifies all T + 1 nodes whatever the threshold, but a layer with nothing worth
  expanding skips its drafter call, so a higher threshold trades accepted tokens for
  cheaper steps, and only the clock can say which wins on this machine. (Choosing "the
  largest threshold whose realised size stays within T" would be empty here: the cap keeps
  every tree within T.) MAL, realised sizes and drafter calls are reported beside each
  grid entry.

* **Measurements per (kind, T, temperature)**, each prompt at batch 1 after an untimed
  warm-up call that compiles its shapes: MAL (tokens committed per target forward, **the
  target's bonus token included**, so MAL >= 1), decode tokens/s, × vanilla, and
  ``mean_tree_size`` (valid nodes per step, root included, from ``res.stats``). Every
  speculative run is paired with a vanilla run of the same prompt, temperature and seed
  just before it, and × vanilla pools those pairs: on a shared machine whose load drifts
  (vanilla alone moved 1.7× between budgets in one run), only back-to-back pairs see the
  same load. At temperature 0 every speculative output is compared token for token with
  its vanilla pair's (greedy decoding is lossless). Each kind's best budget is the one
  with the highest tokens/s relative to its vanilla pairs, per temperature.

* **Mask blocks.** For the first ``block_prompts`` evaluation prompts, every configuration
  also runs step by step (:class:`specjax.runner.SpecRunner`'s draft and verify phases,
  the programs eager mode runs: its output equals the compiled run's) and every drafted
  tree's non-empty (query block x key block) tiles of the ancestor mask are counted
  (:func:`specjax.tree.mask_blocks`), block 32 and 16, in the breadth-first layout and in
  depth-first order (:func:`specjax.tree.dfs_order`). Padding nodes count as the kernel
  sees them (each sees the root and itself).

Work is appended to ``<out stem>.partial.jsonl`` unit by unit (a calibration run, a
vanilla + speculative pair, a block pass) and a restarted run with the same settings
skips what is there. Outputs: ``<out>`` (JSON), ``<stem>_mal.png`` (MAL and × vanilla
against T per kind and temperature) and ``<stem>_blocks.png`` (mask blocks, BFS vs DFS).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from tqdm import tqdm

import specjax
from specjax.bench.common import (
    MAL_NOTE,
    as_command,
    first_mismatch,
    generation_record,
    int_list,
    jsonable,
    machine_info,
    write_json,
)
from specjax.bench.partial import append_record, drafter_stamp, resume_from
from specjax.bench.phases import load_models
from specjax.bench.questions import (
    CALIB_PROMPTS,
    QUESTIONS_ENV,
    TASKS,
    calibration_prompts,
    spec_bench_prompts,
)
from specjax.bench.timing import count_compiles, warmup_tokens
from specjax.bench.tree_report import plot_blocks, plot_mal, plot_paths, summary
from specjax.bench.trees import tree_label
from specjax.defaults import resolve_model
from specjax.loaded import Drafter, Target
from specjax.loop import PAD, bucket
from specjax.runner import Request, SpecRunner, all_done
from specjax.sampling import SamplingConfig
from specjax.speculative import draft_phase_jit, verify_phase_jit
from specjax.tree import (
    DraftTree,
    TreeSpec,
    bfs_order,
    dfs_order,
    eagle2_sizes,
    mask_blocks,
    normalize_paths,
    permute_nodes,
)
from specjax.vocab.head import VocabHead
from specjax.vocab.resolve import resolve_head

KINDS = ("chain", "static", "eagle2", "dyspec", "dyspec-topk", "dyspec-threshold")
BUDGETS = (4, 8, 16, 32)
TEMPERATURES = (0.0, 0.6)
# Sampled trees key slots by the chance of reaching them (chosen 0.1-0.3 here); greedy trees
# by the path product of the drafted node, smaller numbers (0.01 chosen at T <= 8, lower for
# larger T): one grid serves both.
THRESHOLD_GRID = (0.3, 0.1, 0.03, 0.01, 0.003)
BLOCKS = (32, 16)
# Assumed P(rank-r child accepted | parent accepted) for the static trees: rank 0 near the
# shipped SmolLM2 drafter's measured first-draft acceptance (0.29 over Spec-Bench, 0.38 on
# MT-bench), then a fast decay over lower ranks, the shape of Sequoia's measured vectors.
RANK_ACCEPT = (0.4, 0.12, 0.06, 0.04, 0.03, 0.02, 0.015, 0.01)
BLOCK_NOTE = ("non-empty (query block x key block) tiles of the [T+1, T+1] ancestor mask "
              "(specjax.tree.mask_blocks), padding nodes included as the kernel sees them; "
              "bfs = the builders' breadth-first layout, dfs = permute_nodes(tree, "
              "dfs_order(tree)); ratio = mean bfs / mean dfs (> 1: DFS needs fewer tiles)")
THRESHOLD_RULE = ("per (budget, temperature): the grid threshold with the highest decode "
                  "tokens/s on the calibration prompts at cap T, batch 1 (ties: the larger "
                  "threshold); a step verifies T + 1 nodes whatever the threshold, and "
                  "skips the drafter calls of layers with nothing worth expanding")


# --------------------------------------------------------------------------------------
# The trees at a budget
# --------------------------------------------------------------------------------------


def static_paths(budget: int, accept: Sequence[float] = RANK_ACCEPT) -> tuple[tuple[int, ...], ...]:
    """The static tree of ``budget`` drafted nodes that maximises the expected accepted
    length under a positional acceptance vector (Sequoia's model).

    A path's value is the product of ``accept[rank]`` along it; the best open path is
    added until ``budget`` paths are listed (a path's first child and next sibling open
    when it is added, so the list stays prefix-closed with contiguous ranks). Ties go to
    the smaller path. Ranks stop at ``len(accept) - 1``.

    Returns:
      the paths in node order (:func:`specjax.tree.normalize_paths`).
    """
    if budget < 1:
        raise ValueError(f"a static tree needs at least one node, got budget {budget}")
    heap: list[tuple[float, tuple[int, ...]]] = [(-accept[0], (0,))]
    out: list[tuple[int, ...]] = []
    while heap and len(out) < budget:
        neg, path = heapq.heappop(heap)
        out.append(path)
        heapq.heappush(heap, (neg * accept[0], path + (0,)))
        r = path[-1]
        if r + 1 < len(accept):
            heapq.heappush(heap, (neg / accept[r] * accept[r + 1], path[:-1] + (r + 1,)))
    return normalize_paths(out)


def eagle2_shape(budget: int) -> tuple[int, int]:
    """(depth, top_k) of the EAGLE-2 tree at ``budget`` drafted nodes.

    Depth grows with log2(T) (T=4: 3, 8: 4, 16: 5, 32: 6), the beam from 3 to 6: the
    ``bench spec`` grid's shapes. The beam widens further if its pool would hold fewer than
    T candidates.
    """
    depth = min(max(2, int(budget).bit_length()), 8)
    top_k = 3 if budget <= 4 else 4 if budget <= 16 else 6 if budget <= 32 else 8
    while eagle2_sizes(top_k, depth)[1] < budget:
        top_k += 1
    return depth, top_k


def tree_at(kind: str, budget: int, threshold: float | None = None) -> TreeSpec:
    """The ``kind`` tree with ``budget`` drafted nodes (see the module docstring).

    ``threshold`` is required for ``dyspec-threshold``.
    """
    if kind == "chain":
        return TreeSpec("chain", depth=budget)
    if kind == "static":
        return TreeSpec("static", paths=static_paths(budget))
    depth, top_k = eagle2_shape(budget)
    if kind == "eagle2":
        return TreeSpec("eagle2", depth=depth, top_k=top_k, total_tokens=budget)
    if kind in ("dyspec", "dyspec-topk"):
        return TreeSpec("dyspec", total_tokens=budget, topk_children=kind == "dyspec-topk")
    if kind == "dyspec-threshold":
        if threshold is None:
            raise ValueError("a dyspec-threshold tree needs its threshold")
        return TreeSpec("dyspec-threshold", depth=depth, total_tokens=budget,
                        threshold=float(threshold), frontier=min(top_k, budget))
    raise ValueError(f"tree kind must be one of {', '.join(KINDS)}, got {kind!r}")


def tree_fields(tree: TreeSpec) -> dict[str, Any]:
    """The fields that shape ``tree``, its node count T + 1 and its label, for JSON."""
    used = {"chain": ("depth",), "static": ("paths",),
            "eagle2": ("depth", "top_k", "total_tokens"),
            "dyspec": ("total_tokens", "topk_children"),
            "dyspec-threshold": ("depth", "total_tokens", "threshold", "frontier",
                                 "topk_children")}[tree.kind]
    return ({"kind": tree.kind} | {f: getattr(tree, f) for f in used}
            | {"num_nodes": tree.num_nodes, "max_depth": tree.max_depth,
               "label": tree_label(tree)})


def choose_threshold(rows: Sequence[dict[str, Any]]) -> float:
    """The calibration grid entry (``{"threshold", "decode_tokens_per_s", ...}``) that
    decodes fastest; ties go to the larger threshold (smaller trees)."""
    best = max(rows, key=lambda r: (r["decode_tokens_per_s"], r["threshold"]))
    return float(best["threshold"])


# --------------------------------------------------------------------------------------
# Mask blocks of drafted trees
# --------------------------------------------------------------------------------------


@partial(jax.jit, static_argnames=("blocks",))
def tree_tiles(tree: DraftTree, blocks: tuple[int, ...] = BLOCKS) -> Array:
    """[B, 2 * len(blocks) + 1] int32: per block size, the non-empty mask tiles of the
    breadth-first layout then of the depth-first order; last, the valid nodes (root
    included)."""
    bfs = permute_nodes(tree, bfs_order(tree)).ancestors
    dfs = permute_nodes(tree, dfs_order(tree)).ancestors
    cols = []
    for blk in blocks:
        cols += [mask_blocks(bfs, blk), mask_blocks(dfs, blk)]
    cols.append(jnp.sum(tree.valid, axis=1).astype(jnp.int32))
    return jnp.stack(cols, axis=1)


def drafted_tiles(target: Target, drafter: Drafter, head: VocabHead, tree: TreeSpec,
                  ids: list[int], *, max_new_tokens: int, temperature: float, seed: int,
                  stop_on_eos: bool,
                  blocks: tuple[int, ...] = BLOCKS) -> dict[str, Any]:
    """Generate from ``ids`` step by step and count each drafted tree's mask tiles.

    Runs the draft and verify phases that :meth:`specjax.runner.SpecRunner.step` runs
    (eager mode), with the request :func:`specjax.generate` builds for the same arguments,
    so the trees are those of the compiled run (its tokens are returned to check that).

    Returns:
      ``{"tokens": new tokens, "valid_nodes": [steps], "tiles": {block: {"bfs": [steps],
      "dfs": [steps]}}}``.
    """
    sampling = SamplingConfig(temperature=temperature)
    runner = SpecRunner.of(target, drafter, head, tree, sampling)
    req = Request.build(target, [ids], max_new_tokens=max_new_tokens, sampling=sampling,
                        stop_on_eos=stop_on_eos, key=jax.random.PRNGKey(seed), tree=tree)
    p, dp = target.params, runner.drafter.params  # the drafter as the runner lays it out
    state = runner.prefill(req)
    rows = []
    while not all_done(state):
        draft, state = draft_phase_jit(p, dp, head, state, spec=runner.spec)
        rows.append(np.asarray(tree_tiles(draft.tree, blocks))[0])
        state = verify_phase_jit(p, dp, head, state, draft, spec=runner.spec)
    counts = np.asarray(rows, np.int64).reshape(-1, 2 * len(blocks) + 1)
    tokens = [int(t) for t in np.asarray(state.output.tokens)[0] if t != PAD]
    return {"tokens": tokens, "valid_nodes": counts[:, -1].tolist(),
            "tiles": {str(blk): {"bfs": counts[:, 2 * i].tolist(),
                                 "dfs": counts[:, 2 * i + 1].tolist()}
                      for i, blk in enumerate(blocks)}}


def block_summary(recs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Pooled tile counts of block-pass records of one configuration.

    Per block: mean tiles in BFS and DFS layout, their ratio (mean bfs / mean dfs), the
    mean of the per-tree better layout, and how many trees DFS made smaller / larger.
    """
    out: dict[str, Any] = {"trees": sum(len(r["valid_nodes"]) for r in recs),
                           "mean_valid_nodes": _mean([n for r in recs for n in r["valid_nodes"]])}
    for blk in recs[0]["tiles"] if recs else ():
        bfs = np.asarray([x for r in recs for x in r["tiles"][blk]["bfs"]], float)
        dfs = np.asarray([x for r in recs for x in r["tiles"][blk]["dfs"]], float)
        out[f"block{blk}"] = {
            "bfs": float(bfs.mean()), "dfs": float(dfs.mean()),
            "ratio": float(bfs.mean() / dfs.mean()),
            "best_of_both": float(np.minimum(bfs, dfs).mean()),
            "dfs_fewer": int(np.sum(dfs < bfs)), "dfs_more": int(np.sum(dfs > bfs))}
    return out


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TreeBenchConfig:
    """The settings of one ``specjax bench trees`` run.

    Attributes:
      model_dir: a converted target folder.
      drafter_dir: a drafter folder; None for the shipped one; "random" for an untrained
        drafter (pipeline check only).
      per_task: evaluation prompts per task: the first ``per_task`` of each task.
      max_new_tokens: budget per prompt (EOS also stops when ``stop_on_eos``).
      budgets: T values, drafted nodes per step (the root excluded).
      temperatures: 0 = greedy (checked against vanilla); > 0 samples, seeded by ``seed``.
      kinds: tree kinds to compare (a subset of :data:`KINDS`).
      questions: the Spec-Bench ``question.jsonl`` (see :func:`resolve_questions`).
      out: JSON path; plots ``<stem>_mal.png`` and ``<stem>_blocks.png`` beside it,
        partial results in ``<stem>.partial.jsonl`` (removed once the JSON is written).
      tasks: which tasks to evaluate (default all six).
      calib_num_prompts, calib_max_new_tokens: how many calibration prompts (ShareGPT, as
        ``bench spec`` takes them: :func:`specjax.bench.questions.calibration_prompts`)
        and their budget.
      thresholds: the dyspec-threshold grid (see :func:`choose_threshold`).
      block_prompts: the first N evaluation prompts whose drafted trees' mask blocks are
        counted, for every configuration (0: none).
      blocks: block sizes of the mask-block counts.
      seed: the PRNG seed of every call (sampled runs).
      stop_on_eos: whether EOS ends a prompt's generation before ``max_new_tokens``.
      dtype: cast the target's parameters at load ("float32", "bfloat16"; None: as stored).
      resume: reuse matching records of an interrupted run's partial file.
    """

    model_dir: str | Path
    drafter_dir: str | Path | None = None
    per_task: int = 2
    max_new_tokens: int = 64
    budgets: Sequence[int] = BUDGETS
    temperatures: Sequence[float] = TEMPERATURES
    kinds: Sequence[str] = KINDS
    questions: str | Path | None = None
    out: str | Path = "results/bench_trees.json"
    tasks: Sequence[str] = TASKS
    calib_num_prompts: int = CALIB_PROMPTS
    calib_max_new_tokens: int = 48
    thresholds: Sequence[float] = THRESHOLD_GRID
    block_prompts: int = 2
    blocks: Sequence[int] = BLOCKS
    seed: int = 0
    stop_on_eos: bool = True
    dtype: str | None = None
    resume: bool = True

    def __post_init__(self) -> None:
        # Tuples: the config stays hashable and its JSON stable.
        for name in ("budgets", "temperatures", "kinds", "tasks", "thresholds", "blocks"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.per_task < 1 or self.max_new_tokens < 1 or self.block_prompts < 0:
            raise ValueError("need per_task >= 1, max_new_tokens >= 1 and block_prompts >= 0")
        if not self.budgets or min(self.budgets) < 1:
            raise ValueError(f"budgets must be ints >= 1, got {self.budgets}")
        if not self.temperatures or min(self.temperatures) < 0:
            raise ValueError(f"temperatures must be >= 0, got {self.temperatures}")
        bad = [k for k in self.kinds if k not in KINDS]
        if bad or not self.kinds:
            raise ValueError(f"kinds must be among {', '.join(KINDS)}, got {self.kinds}")
        if "dyspec-threshold" in self.kinds and (
                not self.thresholds or not all(0 < t < 1 for t in self.thresholds)):
            raise ValueError(f"thresholds must lie in (0, 1), got {self.thresholds}")
        if not self.blocks or min(self.blocks) < 1:
            raise ValueError(f"blocks must be ints >= 1, got {self.blocks}")


# --------------------------------------------------------------------------------------
# One unit of work each
# --------------------------------------------------------------------------------------


def _temp_tag(t: float) -> str:
    return f"t{t:g}"


class _Generator:
    """Timed B=1 generation; the first call of each (method, temperature, prompt bucket) is
    preceded by an untimed warm-up that compiles its shapes."""

    def __init__(self, target: Target, drafter: Drafter, head: VocabHead, cfg: TreeBenchConfig):
        self.target, self.drafter, self.head, self.cfg = target, drafter, head, cfg
        self.warm: set[tuple[str, float, int]] = set()
        self.warmup_s = 0.0

    def __call__(self, tree: TreeSpec | None, ids: list[int], temperature: float,
                 max_new_tokens: int | None = None) -> dict[str, Any]:
        cfg = self.cfg
        max_new_tokens = max_new_tokens or cfg.max_new_tokens
        kw: dict[str, Any] = {"stop_on_eos": cfg.stop_on_eos, "temperature": temperature,
                              "seed": cfg.seed}
        if tree is not None:
            kw |= {"drafter": self.drafter, "tree": tree, "vocab": self.head}
        tag = ("vanilla" if tree is None else tree_label(tree), temperature, bucket(len(ids)))
        if tag not in self.warm:
            t0 = time.perf_counter()
            specjax.generate(self.target, [ids],
                             max_new_tokens=warmup_tokens(max_new_tokens), **kw)
            self.warmup_s += time.perf_counter() - t0
            self.warm.add(tag)
        with count_compiles() as n:
            res = specjax.generate(self.target, [ids], max_new_tokens=max_new_tokens, **kw)
        return generation_record(res, n[0])


def _timed_pair(gen: _Generator, tree: TreeSpec, ids: list[int], temperature: float,
                what: str) -> dict[str, Any]:
    """A timed vanilla run, then the timed speculative run, compared with it when greedy.

    The speculative record carries its vanilla pair under ``"vanilla"``.
    """
    van = gen(None, ids, temperature)
    rec = gen(tree, ids, temperature) | {"vanilla": van}
    pos = first_mismatch(rec["tokens"], van["tokens"]) if temperature == 0 else None
    if pos is not None:
        tqdm.write(f"!!! GREEDY MISMATCH: {what}: output differs from vanilla at new token "
                   f"{pos} !!!")
    return rec | {"first_mismatch": pos,
                  "greedy_match": (pos is None) if temperature == 0 else None}


def _block_pass(target: Target, drafter: Drafter, head: VocabHead, tree: TreeSpec,
                ids: list[int], compiled_tokens: list[int], **kw: Any) -> dict[str, Any]:
    """:func:`drafted_tiles`, and whether its tokens equal the compiled run's."""
    b = drafted_tiles(target, drafter, head, tree, ids, **kw)
    return b | {"same_as_compiled": b["tokens"] == compiled_tokens}


def calibrate(gen: _Generator, tree: TreeSpec, calib_ids: Sequence[list[int]], *,
              max_new_tokens: int, temperature: float) -> dict[str, Any]:
    """``tree`` over the calibration prompts, one at a time (batch 1, as evaluated: a batch
    skips a drafter call only when every row can): pooled decode tokens/s, MAL, the mean
    realised tree size and drafter calls per step."""
    recs = [gen(tree, list(p), temperature, max_new_tokens) for p in calib_ids]
    pooled = pool_config([r | {"vanilla": r, "greedy_match": None} for r in recs])
    return {"decode_tokens_per_s": pooled["decode_tokens_per_s"], "mal": pooled["mal"],
            "mean_tree_size": pooled["mean_tree_size"],
            "drafted_nodes": pooled["mean_tree_size"] - 1,
            "drafter_calls": pooled["mean_drafter_calls"],
            "target_forwards": pooled["target_forwards"]}


# --------------------------------------------------------------------------------------
# Pooling
# --------------------------------------------------------------------------------------


def _mean(xs: Sequence[float]) -> float | None:
    return float(np.mean(xs)) if len(xs) else None


def _rate(recs: Sequence[dict[str, Any]]) -> float | None:
    """Decode tokens/s pooled as a ratio of sums (the first token comes from prefill)."""
    tokens = sum(r["new_tokens"] - 1 for r in recs)
    secs = sum(r["decode_s"] for r in recs)
    return tokens / secs if recs and secs > 0 else None


def pool_config(spec: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Figures of one (kind, T, temperature) over its prompts.

    MAL pools every step (accepted tokens / target forwards, bonus included);
    ``mean_tree_size`` weighs each prompt by its forwards; rates are ratios of sums, and
    × vanilla compares them with the records' vanilla pairs (``r["vanilla"]``).
    """
    fwd = sum(r["target_forwards"] for r in spec)
    v, s = _rate([r["vanilla"] for r in spec]), _rate(spec)
    greedy = [r for r in spec if r["greedy_match"] is not None]
    return {
        "prompts": len(spec),
        "mal": sum(r["accepted_tokens"] for r in spec) / fwd if fwd else None,
        "target_forwards": fwd,
        "mean_tree_size": (sum(r["mean_tree_size"] * r["target_forwards"] for r in spec) / fwd
                           if fwd else None),
        "mean_drafter_calls": (sum(r["drafter_calls"] * r["target_forwards"] for r in spec)
                               / fwd if fwd and all(r.get("drafter_calls") is not None
                                                    for r in spec) else None),
        "decode_tokens_per_s": s, "vanilla_decode_tokens_per_s": v,
        "speedup_vs_vanilla": s / v if s is not None and v else None,
        "greedy_checked": len(greedy), "greedy_matched": sum(r["greedy_match"] for r in greedy),
    }


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------


def _units(cfg: TreeBenchConfig, evals: Sequence[dict[str, Any]]) -> int:
    """The units of work a full run does (the progress bar's total)."""
    n, b, t = len(evals), len(cfg.budgets), len(cfg.temperatures)
    n_calib = len(cfg.thresholds) if "dyspec-threshold" in cfg.kinds else 0
    blocks = min(cfg.block_prompts, n)
    return t * b * (n_calib + len(cfg.kinds) * (n + blocks))


def run_tree_bench(cfg: TreeBenchConfig, *, prompts: Sequence[dict[str, Any]] | None = None,
                   calib_prompts: Sequence[Sequence[int]] | None = None,
                   drafter: Drafter | None = None) -> dict[str, Any]:
    """Compare the tree kinds at equal budgets; write JSON and two PNGs.

    Args:
      cfg: the run's settings.
      prompts, calib_prompts: internal (tests): pre-tokenised evaluation prompts
        ``{"question_id", "task", "ids"}`` and calibration prompt ids, bypassing questions
        and the tokenizer.
      drafter: internal: an already loaded drafter (overrides ``cfg.drafter_dir``).
    Returns:
      The dict written to ``cfg.out``.
    """
    out = Path(cfg.out)
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    target, drafter, drafter_name = load_models(cfg.model_dir, cfg.dtype, drafter,
                                                cfg.drafter_dir)
    head = resolve_head("full", target, drafter)
    evals, qpath = spec_bench_prompts(target, questions=cfg.questions, tasks=cfg.tasks,
                                      per_task=cfg.per_task, prompts=prompts)
    calib_ids, calib_info = calibration_prompts(target, num=cfg.calib_num_prompts,
                                                questions=cfg.questions, given=calib_prompts)
    block_qids = [p["question_id"] for p in evals[:cfg.block_prompts]]

    config = {
        "model": str(cfg.model_dir), "drafter": drafter_name,
        "dtype": str(target.params.embed.dtype), "per_task": cfg.per_task,
        "max_new_tokens": cfg.max_new_tokens, "budgets": list(cfg.budgets),
        "budget_means": "drafted nodes per step, the root excluded (the target verifies T+1)",
        "temperatures": list(cfg.temperatures), "kinds": list(cfg.kinds), "seed": cfg.seed,
        "tasks": list(dict.fromkeys(p["task"] for p in evals)),
        "question_ids": [p["question_id"] for p in evals],
        "chat_template": prompts is None, "batch_size": 1, "stop_on_eos": cfg.stop_on_eos,
        "turns": "first turn only", "questions": None if qpath is None else str(qpath),
        "calibration": calib_info, "calib_max_new_tokens": cfg.calib_max_new_tokens,
        "thresholds": list(cfg.thresholds), "block_prompts": cfg.block_prompts,
        "block_question_ids": block_qids, "blocks": list(cfg.blocks),
        "static_rank_accept": list(RANK_ACCEPT), "vocab": "full",
    }

    # Resume: units written under the same settings. Which prompts, budgets, kinds and
    # temperatures a run covers is left out of the key: each unit names its own, so a
    # wider run reuses a narrower one's work.
    ppath, old = resume_from(out, cfg.resume)
    stamp = drafter_stamp(drafter)
    key = json.dumps(jsonable({k: v for k, v in config.items()
                               if k not in ("per_task", "budgets", "temperatures", "kinds",
                                            "tasks", "question_ids", "block_prompts",
                                            "block_question_ids")}
                              | {"drafter_mtime": stamp}), sort_keys=True)
    done = {r["unit"]: r for r in old if r.get("key") == key and "unit" in r}
    if done:
        tqdm.write(f"resuming: {len(done)} finished units in {ppath}")
    gen = _Generator(target, drafter, head, cfg)
    bar = tqdm(total=_units(cfg, evals), unit="run")
    counts = {"resumed": 0, "new": 0}

    def unit(uid: str, desc: str, work: Callable[[], dict[str, Any]],
             **fields: Any) -> dict[str, Any]:
        if uid in done:
            counts["resumed"] += 1
            bar.update()
            return done[uid]
        bar.set_description(desc)
        t0 = time.perf_counter()
        rec = {"unit": uid, "key": key, **fields, **work()}
        rec["unit_s"] = time.perf_counter() - t0  # compiles and warm-ups included
        append_record(ppath, rec)
        counts["new"] += 1
        bar.update()
        return rec

    calib_rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    block_recs: list[dict[str, Any]] = []
    trees: dict[str, dict[str, Any]] = {}
    gen_kw = dict(max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, stop_on_eos=cfg.stop_on_eos)
    # Budget-major order: an interrupted run holds whole budgets, every kind compared.
    for temp in cfg.temperatures:
        tt = _temp_tag(temp)
        for budget in cfg.budgets:
            threshold = None
            if "dyspec-threshold" in cfg.kinds:
                grid = []
                for thr in cfg.thresholds:
                    tree = tree_at("dyspec-threshold", budget, thr)
                    grid.append(unit(
                        f"calib|{tree_label(tree)}|{tt}", f"calibrate {tree_label(tree)} {tt}",
                        partial(calibrate, gen, tree, calib_ids,
                                max_new_tokens=cfg.calib_max_new_tokens, temperature=temp),
                        record="calib", budget=budget, temperature=temp, threshold=thr))
                threshold = choose_threshold(grid)
                calib_rows.append({"budget": budget, "temperature": temp,
                                   "chosen_threshold": threshold,
                                   "grid": [{k: g.get(k) for k in (
                                       "threshold", "decode_tokens_per_s", "mal",
                                       "mean_tree_size", "drafted_nodes", "drafter_calls",
                                       "target_forwards")} for g in grid]})
            for kind in cfg.kinds:
                tree = tree_at(kind, budget, threshold)
                label = tree_label(tree)
                trees[label] = tree_fields(tree)
                for p in evals:
                    qid = p["question_id"]
                    rec = unit(f"spec|{label}|q{qid}|{tt}", f"{label} q{qid} {tt}",
                               partial(_timed_pair, gen, tree, p["ids"], temp,
                                       f"question {qid}, {label}"),
                               record="spec", tree_kind=kind, budget=budget, label=label,
                               temperature=temp, question_id=qid, task=p["task"])
                    runs.append(rec)
                    if qid in block_qids:
                        block_recs.append(unit(
                            f"blocks|{label}|q{qid}|{tt}", f"mask blocks {label} q{qid} {tt}",
                            partial(_block_pass, target, drafter, head, tree, p["ids"],
                                    rec["tokens"], temperature=temp, blocks=cfg.blocks,
                                    **gen_kw),
                            record="blocks", tree_kind=kind, budget=budget, label=label,
                            temperature=temp, question_id=qid, num_nodes=tree.num_nodes))
                # Free this configuration's programs before the next one compiles: XLA:CPU
                # maps each executable's code on its own, and a run that kept ~90 large
                # programs died in LLVM ("Cannot allocate memory"; likely vm.max_map_count).
                # The next warm-ups compile (or load from the compilation cache) again.
                jax.clear_caches()
                gen.warm.clear()
    bar.close()

    result = _assemble(cfg, config, evals, runs, calib_rows, block_recs, trees)
    result |= {
        "model_name": Path(cfg.model_dir).name,
        "machine": machine_info() | {"loadavg_start": load_start, "loadavg_end": os.getloadavg()},
        "resumed_units": counts["resumed"], "new_units": counts["new"],
        "warmup_s": gen.warmup_s, "wall_s": time.perf_counter() - t_start,
    }
    write_json(out, result)
    plot_mal(result, plot_paths(out)["mal"])
    plot_blocks(result, plot_paths(out)["blocks"])
    ppath.unlink(missing_ok=True)
    print(summary(result))
    return result


def _assemble(cfg: TreeBenchConfig, config: dict[str, Any], evals: Sequence[dict[str, Any]],
              runs: Sequence[dict[str, Any]],
              calib_rows: Sequence[dict[str, Any]], block_recs: Sequence[dict[str, Any]],
              trees: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The result dict from the run's unit records."""
    results = []
    for temp in cfg.temperatures:
        for budget in cfg.budgets:
            for kind in cfg.kinds:
                recs = [r for r in runs if r["temperature"] == temp and r["budget"] == budget
                        and r["tree_kind"] == kind]
                row = {"kind": kind, "budget": budget, "temperature": temp,
                       "label": recs[0]["label"], "tree": trees[recs[0]["label"]]}
                row |= pool_config(recs)
                brecs = [b for b in block_recs if b["temperature"] == temp
                         and b["budget"] == budget and b["tree_kind"] == kind]
                row["mask_blocks"] = block_summary(brecs) if brecs else None
                results.append(row)

    best = []
    for temp in cfg.temperatures:
        for kind in cfg.kinds:
            rows = [r for r in results if r["temperature"] == temp and r["kind"] == kind
                    and r["speedup_vs_vanilla"] is not None]
            if rows:
                # Tokens/s relative to the paired vanilla runs: raw rates drift with load.
                b = max(rows, key=lambda r: r["speedup_vs_vanilla"])
                best.append({k: b[k] for k in ("kind", "temperature", "budget", "label", "mal",
                                               "decode_tokens_per_s", "speedup_vs_vanilla")})

    mismatches = [{"question_id": r["question_id"], "label": r["label"],
                   "first_mismatch": r["first_mismatch"]}
                  for r in runs if r["greedy_match"] is False]
    greedy = [r for r in runs if r["greedy_match"] is not None]
    van_rates = {_temp_tag(t): _rate([r["vanilla"] for r in runs if r["temperature"] == t])
                 for t in cfg.temperatures}
    big = [r for r in results if r["mask_blocks"] and r["tree"]["num_nodes"] >= 32]
    large = {}
    for blk in cfg.blocks:
        k = f"block{blk}"
        if big:
            bfs = sum(r["mask_blocks"][k]["bfs"] * r["mask_blocks"]["trees"] for r in big)
            dfs = sum(r["mask_blocks"][k]["dfs"] * r["mask_blocks"]["trees"] for r in big)
            large[k] = {"bfs_tiles": bfs, "dfs_tiles": dfs, "ratio": bfs / dfs}
    block_eq = [b["same_as_compiled"] for b in block_recs]
    return {
        "benchmark": "trees", "config": config,
        "mal_note": MAL_NOTE, "mal_counts_bonus_token": True,
        "trees": trees,
        "static_tree_rule": ("grown greedily by the product of assumed positional acceptance "
                             "probabilities static_rank_accept (Sequoia's drafter model)"),
        "threshold_selection": {"rule": THRESHOLD_RULE, "per_budget": list(calib_rows)},
        "vanilla_decode_tokens_per_s": van_rates,
        "results": results, "best_budget": best,
        "greedy_equality": {"matched": sum(r["greedy_match"] for r in greedy),
                            "checked": len(greedy), "all_match": not mismatches,
                            "mismatches": mismatches},
        "mask_blocks": {"note": BLOCK_NOTE, "trees_counted": sum(len(b["valid_nodes"])
                                                                for b in block_recs),
                        "block_passes_equal_compiled": sum(block_eq),
                        "block_passes": len(block_eq),
                        "trees_of_32_nodes_or_more": large or None},
        "timed_compiles": sum(r["compiles_while_timed"] + r["vanilla"]["compiles_while_timed"]
                              for r in runs),
        "per_prompt": [{k: v for k, v in r.items() if k != "key"} for r in runs],
        "block_passes": [{k: v for k, v in r.items() if k not in ("key", "tokens")}
                         for r in block_recs],
        "prompts": [{"question_id": p["question_id"], "task": p["task"],
                     "prompt_tokens": len(p["ids"])} for p in evals],
    }


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}"
                                         ) from None


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_tree_bench_args(p: argparse.ArgumentParser) -> None:
    """Attach ``specjax bench trees``' flags to a (sub)parser."""
    p.add_argument("--model", default=None,
                   help="converted target folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None,
                   help="drafter folder (default: the shipped drafter); 'random' = an "
                        "untrained drafter, to check the pipeline")
    p.add_argument("--per-task", type=int, default=2,
                   help="evaluation prompts per task: the first N of each (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--budgets", type=int_list, default=BUDGETS,
                   help="T values, drafted nodes per step (default 4,8,16,32)")
    p.add_argument("--temperatures", type=_float_list, default=TEMPERATURES,
                   help="0 = greedy, checked against vanilla (default 0,0.6)")
    p.add_argument("--kinds", type=_str_list, default=KINDS,
                   help=f"tree kinds (default {','.join(KINDS)})")
    p.add_argument("--thresholds", type=_float_list, default=THRESHOLD_GRID,
                   help="dyspec-threshold calibration grid (default "
                        f"{','.join(map(str, THRESHOLD_GRID))})")
    p.add_argument("--block-prompts", type=int, default=2,
                   help="the first N evaluation prompts whose drafted trees' mask blocks are "
                        "counted, per configuration (default 2; 0 = none)")
    p.add_argument("--questions", default=None,
                   help=f"Spec-Bench question.jsonl (default: ${QUESTIONS_ENV}, else "
                        "../shared/data/spec_bench/question.jsonl from the repository root)")
    p.add_argument("--tasks", type=_str_list, default=TASKS,
                   help=f"tasks (default {','.join(TASKS)})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="cast parameters at load (default: as stored)")
    p.add_argument("--no-resume", action="store_true",
                   help="ignore and remove the partial results of an interrupted run")
    p.add_argument("--out", default="results/bench_trees.json")


def config_from_args(args: argparse.Namespace) -> TreeBenchConfig:
    """The :class:`TreeBenchConfig` that :func:`add_tree_bench_args`' flags describe."""
    return TreeBenchConfig(resolve_model(args.model), args.drafter, per_task=args.per_task,
                           max_new_tokens=args.max_new_tokens, budgets=args.budgets,
                           temperatures=args.temperatures, kinds=args.kinds,
                           questions=args.questions, out=Path(args.out), tasks=args.tasks,
                           thresholds=args.thresholds, block_prompts=args.block_prompts,
                           seed=args.seed, dtype=args.dtype, resume=not args.no_resume)


def run_tree_bench_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Run :func:`run_tree_bench` from :func:`add_tree_bench_args`' flags."""
    return run_tree_bench(config_from_args(args))


def add_parser(bench: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``trees`` to ``specjax bench``'s subparsers; ``args.run`` runs it."""
    p = bench.add_parser("trees", help="tree kinds at equal budgets: MAL, tokens/s, x vanilla, "
                                       "mask blocks (JSON + plots)")
    add_tree_bench_args(p)
    p.set_defaults(run=as_command(run_tree_bench_from_args))
    return p

