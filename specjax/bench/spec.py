"""``specjax bench spec``: Spec-Bench-style evaluation of speculative decoding on this machine.

One command, one run, one JSON + one PNG:

1. **Tree budget from measured latency.** A verify forward over T tokens costs little more
   than one over a single token only while the matrix products stay bandwidth bound; on a
   2-core CPU that stops early (measured here: a 60-token tree costs ~170 ms, a token ~24 ms).
   So the run measures the target's forward latency (jitted ``forward_hidden`` +
   ``lm_head`` + argmax, B=1, a cache as long as the evaluation's) for T = 1..32 tokens,
   measures the drafter's whole draft phase for each candidate tree of a small grid, takes
   each tree's MAL from a short calibration run on ShareGPT prompts (never Spec-Bench's:
   :func:`specjax.bench.questions.calibration_prompts`),
   and picks the tree maximising ``MAL / (verify_latency(T) + draft_time)``. That estimate
   cannot order trees within a few percent of each other (its calibration is short);
   ``--ab-trees K`` then runs the K best estimated trees (those within ``--ab-within`` of
   the best) end to end on more calibration prompts, paired prompt by prompt
   (:mod:`specjax.bench.paired`), and the fastest there is chosen, or at a speed tie the
   one with a resolved higher MAL (:func:`tie_break`).
2. **Evaluation** on a deterministic Spec-Bench subset (the first ``per_task`` questions of
   each task, first turn, chat template, greedy, batch 1; ``--turns all`` also asks MT-bench's
   second turns after vanilla's first answer, Spec-Bench's own protocol): vanilla decoding,
   speculative compiled and, for the first ``eager_per_task`` prompts of each task,
   speculative eager.
   Every shape bucket is compiled by an untimed warm-up call first. Speculative tokens are
   compared with vanilla tokens for every prompt (greedy decoding is lossless, so they
   must agree; a mismatch is reported loudly, with its first differing position, and does
   not stop the run).
3. **Report** per task and overall: MAL, decode tokens/s of vanilla and speculative
   decoding, speedup (same run, same prompts), compiled-vs-eager speedup, prompts matched.

``--temperature T`` (> 0) evaluates *sampled* decoding instead (``--top-p`` filters every
draw, vanilla's and the verifier's alike): the tree for sampling
(``--tree``'s, or with ``auto`` the drafter's stored one; with ``--add-tree`` candidates it
first runs paired against them end to end at T on calibration prompts, and the winner goes
on: the latency model above prices greedy steps, so nothing is estimated), vanilla and
speculative decoding drawing with one seed a prompt and without stopping at EOS (both decode
the budget, so a prompt's two times cover as many tokens), and the speedup reported with a
95% interval that resamples prompts. The outputs differ from vanilla's by design; that their
distribution is the target's is what the chi-square tests check. Greedy, ``--add-tree``
trees join the grid and always run in the ``--ab-trees`` A/B.

MAL (mean accepted length) is counted the way Spec-Bench and EAGLE count it: tokens
committed per target forward, **the target's bonus token included** (so MAL >= 1; a
useless drafter gives 1.0).

Per-prompt results are appended to ``<out stem>.partial.jsonl`` as they finish, and a
restarted run with the same configuration skips them (and reuses the tree selection).

The tree choice (the estimate, the paired A/B) is in :mod:`~specjax.bench.spec_select`, the
printed table and the plot in :mod:`~specjax.bench.spec_report`. The pieces this run shares
with the other benchmarks live beside it: the questions in
:mod:`~specjax.bench.questions`, timing and the latency curve in
:mod:`~specjax.bench.timing`, the draft phase and drafters in :mod:`~specjax.bench.phases`,
tree flags and names in :mod:`~specjax.bench.trees`, the partial file in
:mod:`~specjax.bench.partial`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

import specjax
from specjax.bench.common import (
    MAL_NOTE,
    as_command,
    first_mismatch,
    generation_record,
    jsonable,
    machine_info,
    paired_speedup,
    write_json,
)
from specjax.bench.partial import append_record, drafter_stamp, resume_from
from specjax.bench.phases import load_models
from specjax.bench.questions import (
    CALIB_PROMPTS,
    QUESTIONS_ENV,
    TASKS,
    calibration_prompts,
    follow_up_ids,
    spec_bench_prompts,
)
from specjax.bench.spec_report import SAMPLING_NOTE, plot_spec, summary
from specjax.bench.spec_select import (
    AB_LONG_SHARE,
    AB_MAX_PROMPT_TOKENS,
    ab_prompts,
    paired_ab,
    select_tree,
    tie_break,
    with_lookup,
)
from specjax.bench.timing import (
    cache_geometry,
    count_compiles,
    ensure_warm,
    latency_curve,
    warmup_tokens,
)
from specjax.bench.trees import add_tree_args, tree_dict, tree_from_args, tree_label
from specjax.defaults import resolve_model
from specjax.loaded import Drafter, Target
from specjax.loop import bucket
from specjax.speculative import TreeSpec, spare_rows
from specjax.tree.default import nearest_temperature
from specjax.vocab.head import VocabHead
from specjax.vocab.resolve import resolve_head

# Calibration uses short-prompt tasks only: each config compiles once per prompt bucket,
# and summarization / rag prompts (~700-1600 tokens) would add a 1024-2048 bucket per config.
LATENCY_SIZES = (1, 2, 4, 8, 12, 16, 24, 32)
# Trees with T = num_nodes <= 32 (T + 1 <= 32 draft tokens + root): on a 2-core CPU a larger
# verify costs several decode steps, so bigger trees cannot pay off.
# A chain of 1 is where a weak drafter on a cheap-to-widen target (Gemma 3: T=2 costs
# 1.14x T=1) pays; deeper chains and trees where acceptance is higher.
DEFAULT_GRID = (
    TreeSpec("chain", depth=1), TreeSpec("chain", depth=2), TreeSpec("chain", depth=3),
    TreeSpec("chain", depth=4), TreeSpec("chain", depth=5),
    TreeSpec("eagle2", depth=3, top_k=3, total_tokens=6),
    TreeSpec("eagle2", depth=4, top_k=4, total_tokens=8),
    TreeSpec("eagle2", depth=4, top_k=4, total_tokens=12),
    TreeSpec("eagle2", depth=5, top_k=4, total_tokens=16),
    TreeSpec("eagle2", depth=6, top_k=6, total_tokens=24),
)
# How a run's config names the turns it asks (``--turns``).
TURNS_NOTE = {"first": "first turn only",
              "all": "every turn (Spec-Bench's protocol), each later one after vanilla "
                     "decoding's answers to the turns before"}


# --------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------


class _Runner:
    """Runs one method on one prompt, warming each (method, prompt bucket) up first."""

    def __init__(self, target: Target, drafter: Drafter, tree: TreeSpec, max_new_tokens: int,
                 stop_on_eos: bool, head: VocabHead, temperature: float = 0.0,
                 top_p: float = 1.0):
        self.target, self.drafter, self.tree, self.head = target, drafter, tree, head
        self.max_new_tokens, self.stop_on_eos = max_new_tokens, stop_on_eos
        self.temperature, self.top_p = temperature, top_p
        self.warm: set[tuple[str, int]] = set()
        self.warmup_s = 0.0

    def __call__(self, method: str, ids: list[int], seed: int = 0) -> dict[str, Any]:
        kw: dict[str, Any] = {"stop_on_eos": self.stop_on_eos, "temperature": self.temperature,
                              "top_p": self.top_p, "seed": seed}
        if method != "vanilla":
            kw |= {"drafter": self.drafter, "tree": self.tree, "vocab": self.head,
                   "mode": "eager" if method == "eager" else "compiled"}
        t0 = time.perf_counter()
        ensure_warm(self.warm, (method, bucket(len(ids))), lambda: specjax.generate(
            self.target, [ids], max_new_tokens=warmup_tokens(self.max_new_tokens), **kw))
        self.warmup_s += time.perf_counter() - t0
        with count_compiles() as n:
            res = specjax.generate(self.target, [ids], max_new_tokens=self.max_new_tokens, **kw)
        return generation_record(res, n[0])


def _turn_count(p: dict[str, Any]) -> int:
    """How many turns of evaluation prompt ``p`` a run asks: one, or with ``--turns all``
    every turn of the question (``"turns"``; tests: 1 + ``len(p["later_ids"])``)."""
    if "turns" in p:
        return len(p["turns"])
    return 1 + len(p.get("later_ids", []))


def _follow_up(target: Target, p: dict[str, Any], ids: list[int],
               answers: Sequence[list[int]]) -> list[int]:
    """Prompt ids of turn ``len(answers) + 1`` of ``p``, its earlier turns answered by
    ``answers``: through the chat template (:func:`follow_up_ids`), or in tests the
    previous turn's ids, its answer and the next turn's given ids, as they are."""
    if "turns" in p:
        return follow_up_ids(target, p["turns"], answers)
    return [*ids, *answers[-1], *p["later_ids"][len(answers) - 1]]


def _run_turn(runner: _Runner, p: dict[str, Any], ids: list[int], turn: int, *, seed: int,
              eager: bool, greedy: bool, bar: tqdm) -> dict[str, Any]:
    """One turn of one evaluation prompt: vanilla, speculative and maybe eager decoding of
    ``ids``, checked token for token against vanilla where greedy (a mismatch is shouted,
    and recorded)."""
    qid = p["question_id"]
    bar.set_description(f"q{qid} {p['task']}" + (f" turn {turn}" if turn > 1 else ""))
    rec = {"question_id": qid, "turn": turn, "task": p["task"], "category": p["category"],
           "prompt_tokens": len(ids), "seed": seed}
    rec["vanilla"] = runner("vanilla", ids, seed)
    rec["spec"] = runner("spec", ids, seed)
    ref = rec["vanilla"]["tokens"] if greedy else None
    rec["first_mismatch"] = first_mismatch(rec["spec"]["tokens"], ref) if greedy else None
    rec["greedy_match"] = rec["first_mismatch"] is None if greedy else None
    bar.update()
    rec["eager"] = rec["eager_first_mismatch"] = rec["eager_match"] = None
    if eager:
        bar.set_description(f"q{qid} {p['task']} eager")
        rec["eager"] = runner("eager", ids, seed)
        if greedy:
            rec["eager_first_mismatch"] = first_mismatch(rec["eager"]["tokens"], ref)
            rec["eager_match"] = rec["eager_first_mismatch"] is None
        bar.update()
    for name, pos in (("speculative", rec["first_mismatch"]),
                      ("eager speculative", rec["eager_first_mismatch"])):
        if pos is not None:
            tqdm.write(f"!!! GREEDY MISMATCH: question {qid} turn {turn} ({p['task']}): {name} "
                       f"output differs from vanilla at new token {pos} !!!")
    return rec


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


def _speedup_ci95(records: Sequence[dict[str, Any]]) -> list[float] | None:
    """The speedup's 95% interval over the prompts (:func:`paired_speedup`), or None."""
    sp = paired_speedup([r["vanilla"] for r in records], [r["spec"] for r in records])
    return None if sp is None else sp["ci95"]


def _count(records: Sequence[dict[str, Any]], key: str) -> int | None:
    """How many records have ``key`` True; None where it was not checked (sampling)."""
    flags = [r[key] for r in records]
    return None if any(f is None for f in flags) else sum(flags)


def aggregate(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Pooled figures of a group of prompt records.

    MAL pools every step: accepted tokens / target forwards (bonus included). Rates are
    ratios of sums (tokens / seconds), so long outputs weigh more than short ones. The
    equality counts are None when sampling (nothing to compare token for token).
    """
    spec = [r["spec"] for r in records]
    fwd = sum(s["target_forwards"] for s in spec)
    eager_recs = [r for r in records if r.get("eager")]
    v, s = _pool(records, "vanilla"), _pool(records, "spec")
    s_on_eager, e = _pool(eager_recs, "spec"), _pool(eager_recs, "eager")
    draft = sum(r["eager"]["draft_s"] for r in eager_recs)
    verify = sum(r["eager"]["verify_s"] for r in eager_recs)
    return {
        "prompts": len(records), "matched": _count(records, "greedy_match"),
        "mal": sum(x["accepted_tokens"] for x in spec) / fwd if fwd else None,
        "vanilla_decode_tokens_per_s": v["decode_tokens_per_s"],
        "spec_decode_tokens_per_s": s["decode_tokens_per_s"],
        "speedup": _ratio(s["decode_tokens_per_s"], v["decode_tokens_per_s"]),
        "speedup_ci95": _speedup_ci95(records),
        "e2e_speedup": _ratio(s["tokens_per_s"], v["tokens_per_s"]),
        "eager_prompts": len(eager_recs),
        "eager_matched": _count(eager_recs, "eager_match"),
        "eager_decode_tokens_per_s": e["decode_tokens_per_s"],
        "eager_speedup": _ratio(e["decode_tokens_per_s"],
                                _pool(eager_recs, "vanilla")["decode_tokens_per_s"]),
        "compiled_vs_eager": _ratio(s_on_eager["decode_tokens_per_s"], e["decode_tokens_per_s"]),
        "eager_draft_fraction": draft / (draft + verify) if draft + verify > 0 else None,
    }


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SpecBenchConfig:
    """The settings of one ``specjax bench spec`` run.

    Attributes:
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
      grid: the candidate trees when ``tree`` is None.
      calib_num_prompts, calib_max_new_tokens: how many calibration prompts (ShareGPT, see
        :func:`specjax.bench.questions.calibration_prompts`) and their budget.
      latency_sizes: T values of the latency curve (every tree's node count is added).
      runs: timed repeats of each micro-benchmark (after one untimed compile call).
      stop_on_eos: whether EOS ends a prompt's generation before ``max_new_tokens``.
      dtype: cast the target's parameters at load ("float32", "bfloat16"; None: as stored).
      resume: reuse matching records of an interrupted run's partial file.
      vocab: the drafter's vocabulary head spec ("full", "fr:8192", "dynaspec", ...; see
        :func:`specjax.vocab.resolve_head`) or a built head, used for calibration, draft
        timing and evaluation; None: the drafter's measured default head, else full.
        Verification is always over the full vocabulary.
      grid_add_default: also consider the drafter's stored greedy tree (its
        ``default_tree.json``; a static tree, say, which the grid lacks), so a run can say
        whether the shipped default still wins; with ``ab_trees`` it always runs in the
        paired A/B.
      ab_trees: 0, or how many of the best estimated trees (those within ``ab_within``, a
        fraction, of the best estimate) run end to end on ``ab_prompts`` calibration
        prompts of Spec-Bench's mix of lengths to choose from (:func:`tie_break`).
      add_trees: candidates the grid lacks. Greedy, they join the grid and, with
        ``ab_trees``, always run in the paired A/B (as the stored default does with
        ``grid_add_default``). At ``temperature`` > 0 they run paired against the tree for
        sampling, end to end at that temperature on ``ab_prompts`` calibration prompts
        (:func:`paired_ab`; no estimate: its latency model prices greedy steps), and the
        chosen tree is evaluated.
      temperature: 0 (greedy), or > 0 to evaluate *sampled* decoding: the tree for
        sampling (``tree``, else the drafter's stored one, ``Drafter.tree_for``; or the
        winner among it and ``add_trees``), vanilla and speculative decoding drawing with
        the same seed per prompt (``seed`` + the prompt's index), and without stopping at
        EOS, so both decode ``max_new_tokens`` and a prompt's two times are over as many
        tokens. Outputs then differ from vanilla's by design (only their distribution is
        the target's, which the chi-square tests check), so no equality is counted.
      seed: the first prompt's seed at ``temperature`` > 0 (and the paired A/B's there).
      turns: ``"first"``, each question's first turn (the issue's 24 prompts); or ``"all"``,
        Spec-Bench's protocol: every turn, a later one asked after the conversation so far
        (:func:`~specjax.bench.questions.follow_up_ids`) in which each earlier turn is
        answered by vanilla decoding's output (the target's own; greedy, the speculative
        output is the same, and sampled, both methods then read one context, so the pair
        stays paired). MT-bench's questions have two turns, the other tasks' one; the task
        and overall figures pool every turn, and ``per_turn`` splits them.
    """

    model_dir: str | Path
    drafter_dir: str | Path | None = None
    per_task: int = 4
    max_new_tokens: int = 128
    tree: TreeSpec | None = None
    questions: str | Path | None = None
    out: str | Path = "results/bench_spec.json"
    tasks: Sequence[str] = TASKS
    eager_per_task: int = 1
    grid: Sequence[TreeSpec] = DEFAULT_GRID
    calib_num_prompts: int = CALIB_PROMPTS
    calib_max_new_tokens: int = 48
    latency_sizes: Sequence[int] = LATENCY_SIZES
    runs: int = 7
    stop_on_eos: bool = True
    dtype: str | None = None
    resume: bool = True
    vocab: str | VocabHead | None = None
    grid_add_default: bool = False
    ab_trees: int = 0
    ab_within: float = 0.05
    ab_prompts: int = 24
    add_trees: Sequence[TreeSpec] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    turns: str = "first"

    def __post_init__(self) -> None:
        if self.turns not in ("first", "all"):
            raise ValueError(f"turns is 'first' or 'all', got {self.turns!r}")
        if self.per_task < 1 or self.max_new_tokens < 1 or self.eager_per_task < 0:
            raise ValueError("need per_task >= 1, max_new_tokens >= 1 and eager_per_task >= 0")
        if not self.temperature >= 0:  # also refuses NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1 or (self.top_p < 1 and self.temperature == 0):
            raise ValueError(f"top_p is in (0, 1] and filters sampled draws (--temperature > "
                             f"0), got {self.top_p} at temperature {self.temperature}")
        if self.temperature > 0 and (self.ab_trees or self.grid_add_default):
            raise ValueError(
                "at temperature > 0 bench spec estimates nothing (its latency model prices "
                "greedy steps): drop --ab-trees / --grid-add-default, and give the trees to "
                "run paired against the tree for sampling with --add-tree")
        if not self.trees and not self.grid_add_default:
            raise ValueError("the tree grid is empty")
        if self.ab_trees == 1 or self.ab_trees < 0:
            raise ValueError(f"ab_trees is 0 (no paired run) or at least 2 trees to compare, "
                             f"got {self.ab_trees}")
        if not 0 < self.ab_within < 1 or self.ab_prompts < 2:
            raise ValueError(f"need 0 < ab_within < 1 and ab_prompts >= 2, got "
                             f"{self.ab_within} and {self.ab_prompts}")
        if self.tree is not None and self.greedy and (
                self.ab_trees or self.grid_add_default or self.add_trees):
            raise ValueError("a given tree is not chosen: drop --ab-trees / --grid-add-default "
                             "/ --add-tree, or the tree, to choose from the grid")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def trees(self) -> tuple[TreeSpec, ...]:
        """The trees the run considers: ``tree`` alone when given, else the grid."""
        return (self.tree,) if self.tree is not None else tuple(self.grid)

    def curve_sizes(self, trees: Sequence[TreeSpec]) -> list[int]:
        """The latency curve's T values: ``latency_sizes``, 1 (vanilla decoding), and the
        largest of ``trees``' node counts, so that no estimate extrapolates the curve."""
        sizes = sorted({int(t) for t in self.latency_sizes} | {1})
        largest = max(t.num_nodes for t in trees)
        return sizes + [largest] if largest > sizes[-1] else sizes


def candidates(cfg: SpecBenchConfig, drafter: Drafter,
               drafter_name: str) -> tuple[tuple[TreeSpec, ...], list[int]]:
    """(the trees a run considers, the indices among them that always run in a paired A/B).

    Greedy: the grid (or the given tree), then ``add_trees`` and with ``grid_add_default``
    the drafter's stored greedy tree, each once; those added always run. At temperature > 0:
    the tree for sampling (given, else the drafter's), then ``add_trees``: all of them run.

    Raises:
      ValueError: ``grid_add_default`` with a drafter that stores no greedy tree.
    """
    if cfg.greedy:
        first, added = cfg.trees, list(cfg.add_trees)
        if cfg.grid_add_default:
            if drafter.default_tree is None:
                raise ValueError(f"drafter {drafter_name} stores no default tree to add to "
                                 "the grid (its default_tree.json); drop --grid-add-default")
            added.append(drafter.default_tree)
    else:
        first, added = (cfg.tree or drafter.tree_for(cfg.temperature),), list(cfg.add_trees)
    grid: list[TreeSpec] = []
    for t in (*first, *added):
        if t not in grid:
            grid.append(t)
    keep = [grid.index(t) for t in added] if cfg.greedy else list(range(len(grid)))
    return tuple(grid), list(dict.fromkeys(keep))


def _selection(cfg: SpecBenchConfig, target: Target, drafter: Drafter,
               grid: Sequence[TreeSpec], keep: Sequence[int], head: VocabHead,
               calib_ids: Sequence[list[int]], *, mean_prompt: int, context: int,
               capacity: int, stop_on_eos: bool, ab_prompts: Sequence[Sequence[int]] | None,
               bar: tqdm) -> dict[str, Any]:
    """The greedy tree choice: the latency curve, the estimate over ``grid``
    (:func:`select_tree`) and, with ``cfg.ab_trees``, the paired A/B (:func:`tie_break`);
    the selection dict with the curve under ``"latency"``."""
    curve = latency_curve(target, cfg.curve_sizes(grid), context=context, capacity=capacity,
                          runs=cfg.runs, bar=bar)
    selection = select_tree(target, drafter, grid, calib_ids, curve, prompt_len=mean_prompt,
                            max_new_tokens=cfg.max_new_tokens,
                            calib_max_new_tokens=cfg.calib_max_new_tokens,
                            stop_on_eos=stop_on_eos, runs=cfg.runs, head=head, bar=bar)
    if cfg.ab_trees:
        bar.set_description("paired A/B of the best estimates")
        ab_ids, ab_info = _ab_prompts(cfg, target, ab_prompts)
        selection = tie_break(target, drafter, grid, selection, ab_ids, k=cfg.ab_trees,
                              within=cfg.ab_within, max_new_tokens=cfg.max_new_tokens,
                              stop_on_eos=stop_on_eos, head=head, keep=keep)
        selection["ab"]["source"] = ab_info
        bar.update()
    return selection | {"latency": curve}


def _sampled_selection(cfg: SpecBenchConfig, target: Target, drafter: Drafter,
                       grid: Sequence[TreeSpec], head: VocabHead,
                       ab_prompts: Sequence[Sequence[int]] | None) -> dict[str, Any]:
    """The tree for sampling among ``grid`` (the incumbent first): :func:`paired_ab` at
    ``cfg.temperature`` on calibration prompts of Spec-Bench's mix of lengths, without an
    EOS stop (every row decodes the budget, so the trees' times cover as many tokens)."""
    ab_ids, ab_info = _ab_prompts(cfg, target, ab_prompts)
    labels = [tree_label(t) for t in grid]
    record, j = paired_ab(target, drafter, grid, labels, ab_ids,
                          max_new_tokens=cfg.max_new_tokens, stop_on_eos=False, head=head,
                          temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed)
    rows = [{"label": label, "tree": tree_dict(t)} for label, t in zip(labels, grid,
                                                                        strict=True)]
    return {"grid": rows, "chosen_index": j, "chosen": rows[j],
            "ab": {"candidates": labels, "always_run": labels, "source": ab_info, **record}}


def _ab_prompts(cfg: SpecBenchConfig, target: Target,
                given: Sequence[Sequence[int]] | None) -> tuple[list[list[int]], dict[str, Any]]:
    """The paired A/B's calibration prompts: ``cfg.ab_prompts`` of Spec-Bench's mix of
    lengths (never Spec-Bench's own); ``given`` in tests."""
    return ab_prompts(target, cfg.ab_prompts, questions=cfg.questions, given=given)


def _sampled_tree_source(drafter: Drafter, temperature: float) -> str:
    """Where ``Drafter.tree_for`` took a tree for sampling at ``temperature`` from, for the
    report."""
    if (t := nearest_temperature(drafter.sampled_trees, temperature)) is not None:
        return f"the drafter's tree for sampling measured at temperature {t:g}"
    if drafter.default_tree is not None:
        return "the drafter's greedy tree: it stores none for sampling"
    return "TreeSpec()'s defaults: the drafter stores no tree"


def run_spec_bench(cfg: SpecBenchConfig, *, prompts: Sequence[dict[str, Any]] | None = None,
                   calib_prompts: Sequence[Sequence[int]] | None = None,
                   ab_prompts: Sequence[Sequence[int]] | None = None,
                   drafter: Drafter | None = None) -> dict[str, Any]:
    """Benchmark speculative decoding on a Spec-Bench subset, greedy (or sampled, at
    ``cfg.temperature`` > 0); write JSON + PNG.

    Args:
      cfg: the run's settings.
      prompts, calib_prompts, ab_prompts: internal (tests): pre-tokenised evaluation prompts
        ``{"question_id", "task", "ids"}``, calibration prompt ids and the paired run's,
        bypassing questions and the tokenizer.
      drafter: internal: an already loaded drafter (overrides ``cfg.drafter_dir``).
    Returns:
      The dict written to ``cfg.out``.
    Raises:
      ValueError: ``cfg.grid_add_default`` with a drafter that stores no greedy tree.
    """
    max_new_tokens, greedy = cfg.max_new_tokens, cfg.greedy
    stop_on_eos = cfg.stop_on_eos and greedy  # sampling runs to the budget: see the config
    out = Path(cfg.out)
    t_start = time.perf_counter()
    load_start = os.getloadavg()

    target, drafter, drafter_name = load_models(cfg.model_dir, cfg.dtype, drafter,
                                                cfg.drafter_dir)
    grid, keep = candidates(cfg, drafter, drafter_name)
    vocab = cfg.vocab or drafter.default_vocab or "full"
    head = resolve_head(vocab, target, drafter)

    evals, qpath = spec_bench_prompts(target, questions=cfg.questions, tasks=cfg.tasks,
                                      per_task=cfg.per_task, prompts=prompts,
                                      all_turns=cfg.turns == "all")
    task_order = [t for t in dict.fromkeys(p["task"] for p in evals)]
    eager_qids = {p["question_id"] for t in task_order
                  for p in [q for q in evals if q["task"] == t][:cfg.eager_per_task]}
    config = {
        "model": str(cfg.model_dir), "drafter": drafter_name,
        "dtype": str(target.params.embed.dtype), "per_task": cfg.per_task,
        "max_new_tokens": max_new_tokens, "tasks": task_order,
        "eager_per_task": cfg.eager_per_task, "greedy": greedy,
        "temperature": cfg.temperature, "top_p": cfg.top_p, "chat_template": prompts is None,
        "batch_size": 1, "stop_on_eos": stop_on_eos, "turns": TURNS_NOTE[cfg.turns],
        "questions": None if qpath is None else str(qpath),
        "tree_mode": ("auto" if greedy and cfg.tree is None else
                      "paired" if len(grid) > 1 else
                      "given" if cfg.tree is not None
                      else _sampled_tree_source(drafter, cfg.temperature)),
        "vocab": vocab if isinstance(vocab, str) else repr(head),
    }
    if greedy:
        calib_ids, calib_info = calibration_prompts(target, num=cfg.calib_num_prompts,
                                                    questions=cfg.questions,
                                                    given=calib_prompts)
        mean_prompt = int(round(np.mean([len(p["ids"]) for p in evals])))
        # Spare rows for the largest write: a T-token forward or a tree's drafter workspace.
        sizes = cfg.curve_sizes(grid)
        spare = max(sizes[-1], *map(spare_rows, grid))
        context, capacity = cache_geometry(mean_prompt, max_new_tokens, spare)
        config |= {"grid": [tree_dict(t) for t in grid], "calibration": calib_info,
                   "calib_max_new_tokens": cfg.calib_max_new_tokens, "latency_sizes": sizes,
                   "runs": cfg.runs, "latency_context": context, "latency_capacity": capacity,
                   "ab_trees": cfg.ab_trees}
        if cfg.ab_trees:
            config |= {"ab_within": cfg.ab_within}
    else:
        config |= {"seed": cfg.seed, "grid": [tree_dict(t) for t in grid]}
    if cfg.ab_trees or (len(grid) > 1 and not greedy):
        config |= {"ab_prompts": cfg.ab_prompts, "ab_long_share": AB_LONG_SHARE,
                   "ab_max_prompt_tokens": AB_MAX_PROMPT_TOKENS}

    # Resume: a selection and prompt records written under the same configuration.
    ppath, old = resume_from(out, cfg.resume)
    stamp = drafter_stamp(drafter)
    sel_key = json.dumps(jsonable({k: v for k, v in config.items()
                                    if k not in ("per_task", "tasks", "eager_per_task")}
                                   | {"drafter_mtime": stamp}), sort_keys=True)
    selection = next((r["selection"] for r in old
                      if r.get("kind") == "selection" and r.get("key") == sel_key), None)
    choosing = selection is None and (greedy or len(grid) > 1)
    # The bar's steps: the curve's sizes, each tree's calibration and the A/B when greedy;
    # the A/B alone when sampled; then every turn asked (the first twice when it also runs
    # eager).
    n_steps = sum(map(_turn_count, evals)) + len(eager_qids)
    if choosing:
        n_steps += (len(config["latency_sizes"]) + len(grid) + bool(cfg.ab_trees) if greedy
                    else 1)
    bar = tqdm(total=n_steps, unit="step")
    if choosing:
        if greedy:
            selection = _selection(cfg, target, drafter, grid, keep, head, calib_ids,
                                   mean_prompt=mean_prompt, context=context,
                                   capacity=capacity, stop_on_eos=stop_on_eos,
                                   ab_prompts=ab_prompts, bar=bar)
        else:
            bar.set_description(f"paired A/B at temperature {cfg.temperature:g}")
            selection = _sampled_selection(cfg, target, drafter, grid, head, ab_prompts)
            bar.update()
        append_record(ppath, {"kind": "selection", "key": sel_key, "selection": selection})
        if len(grid) > 1:
            # Every calibrated tree's programs hold memory maps; twenty-odd trees come near
            # Linux's limit, where generate drops all programs (compile_cache), and a drop in
            # the middle of the evaluation recompiles programs its warm-ups already built
            # inside timed calls (seventy-fourth session: 20 of them). Dropping them here,
            # before the warm-ups, leaves the evaluation's few programs far from the limit.
            jax.clear_caches()
    elif selection is not None:
        tqdm.write(f"resuming: reusing the tree selection in {ppath}")
    chosen_tree = grid[0] if selection is None else grid[selection["chosen_index"]]
    run_key = json.dumps({"sel": sel_key, "tree": tree_dict(chosen_tree)}, sort_keys=True)
    done = {(r["question_id"], r.get("turn", 1)): r for r in old
            if r.get("kind") == "prompt" and r.get("key") == run_key
            and (r["eager"] is not None) == (r["question_id"] in eager_qids
                                             and r.get("turn", 1) == 1)}

    runner = _Runner(target, drafter, chosen_tree, max_new_tokens, stop_on_eos, head,
                     cfg.temperature, cfg.top_p)
    records = []
    for i, p in enumerate(evals):
        qid, ids, answers = p["question_id"], p["ids"], []
        for turn in range(1, _turn_count(p) + 1):
            if turn > 1:  # the conversation so far, answered by vanilla (the target)
                ids = _follow_up(target, p, ids, answers)
            eager = qid in eager_qids and turn == 1
            if (qid, turn) in done:
                rec = done[(qid, turn)]
                bar.update(2 if eager else 1)
            else:
                # One seed a prompt, shared by its methods (it does not matter when greedy).
                rec = _run_turn(runner, p, ids, turn, seed=cfg.seed + i + len(evals) * (
                    turn - 1), eager=eager, greedy=greedy, bar=bar)
                rec |= {"kind": "prompt", "key": run_key}
                append_record(ppath, rec)
            records.append(rec)
            answers.append(rec["vanilla"]["tokens"])
    bar.close()

    by_task = {t: aggregate([r for r in records if r["task"] == t]) for t in task_order}
    # Every shape was compiled by a warm-up; a compile inside a timed call means a cache
    # miss (a recompile) that inflated that call's time.
    timed_compiles = sum(r[m]["compiles_while_timed"] for r in records
                         for m in ("vanilla", "spec", "eager") if r.get(m))
    overall = aggregate(records)
    turns = sorted({r.get("turn", 1) for r in records})
    mismatches = [{"question_id": r["question_id"], "turn": r.get("turn", 1), "task": r["task"],
                   "first_mismatch": r["first_mismatch"],
                   "eager_first_mismatch": r["eager_first_mismatch"]}
                  for r in records if r["greedy_match"] is False or r["eager_match"] is False]
    result = {
        "benchmark": "spec", "model_name": Path(cfg.model_dir).name, "config": config,
        "machine": machine_info() | {"loadavg_start": load_start,
                                     "loadavg_end": os.getloadavg()},
        "mal_note": MAL_NOTE, "mal_counts_bonus_token": True,
        "tree": tree_dict(chosen_tree), "tree_label": tree_label(chosen_tree),
        "latency": selection["latency"] if greedy else None, "tree_selection": selection,
        "per_task": by_task, "overall": overall, "timed_compiles": timed_compiles,
        "per_turn": None if cfg.turns == "first" else {
            str(t): aggregate([r for r in records if r.get("turn", 1) == t]) for t in turns},
        "greedy_equality": None if not greedy else {
            "matched": overall["matched"], "prompts": len(records), "all_match": not mismatches,
            "mismatches": mismatches},
        "sampling": None if greedy else {
            "temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed,
            "note": SAMPLING_NOTE},
        "prediction": None if not greedy else {
            "est_tokens_per_s": selection["chosen"]["est_tokens_per_s"],
            "realized_spec_decode_tokens_per_s": overall["spec_decode_tokens_per_s"],
            "calibration_mal": selection["chosen"]["mal"], "evaluation_mal": overall["mal"],
            "est_speedup": selection["chosen"]["est_speedup"],
            "realized_speedup": overall["speedup"]},
        "resumed_prompts": len([r for r in records
                                if (r["question_id"], r.get("turn", 1)) in done]),
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
# Command line
# --------------------------------------------------------------------------------------


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
    p.add_argument("--vocab", default=None,
                   help="drafter vocabulary head: full, fr:N, pafr:N, dynaspec, ... (default: "
                        "the drafter's measured head, else full)")
    p.add_argument("--no-resume", action="store_true",
                   help="ignore and remove the partial results of an interrupted run")
    p.add_argument("--grid-max-nodes", type=int, default=max(t.num_nodes for t in DEFAULT_GRID),
                   help="--tree auto: calibrate only the grid's trees of at most this many "
                        "nodes, root included, before any lookup chain (default: all; each "
                        "tree compiles its own programs, and XLA:CPU ran out of memory "
                        "mappings after ~25 trees with gated chains here)")
    p.add_argument("--grid-add-default", action="store_true",
                   help="--tree auto: also consider the drafter's stored greedy tree (its "
                        "default_tree.json), so the run says whether it still wins; with "
                        "--ab-trees it always runs in the paired A/B")
    p.add_argument("--ab-trees", type=int, default=0, metavar="K",
                   help="--tree auto: run the K best estimated trees (those within "
                        "--ab-within of the best) end to end on --ab-prompts calibration "
                        "prompts, paired, and choose the fastest, or at a speed tie the "
                        "resolved higher MAL (default 0: the estimate decides; it cannot "
                        "order trees within a few percent)")
    p.add_argument("--ab-within", type=float, default=0.05, metavar="F",
                   help="with --ab-trees: how far below the best estimate (a fraction) a "
                        "tree may be and still run (default 0.05)")
    p.add_argument("--ab-prompts", type=int, default=24, metavar="N",
                   help="with --ab-trees (or --add-tree when sampling): about N calibration "
                        "prompts (ShareGPT's calibration range, a third with a long text; "
                        "never Spec-Bench) (default 24)")
    p.add_argument("--add-tree", action="append", default=[], metavar="JSON",
                   help="a candidate tree as TreeSpec JSON (repeat for more): greedy, it joins "
                        "the grid and with --ab-trees always runs in the A/B; at --temperature "
                        "> 0 it runs end to end, paired, against the tree for sampling on "
                        "--ab-prompts calibration prompts, and the chosen one is evaluated")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 (default): greedy, the output checked against vanilla's token for "
                        "token; > 0: sampled, vanilla and speculative decoding with one seed a "
                        "prompt and no EOS stop, the speedup with a 95%% interval over prompts; "
                        "the tree is --tree's, or with auto the drafter's stored tree for "
                        "sampling, or the winner of a paired A/B against --add-tree's")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="with --temperature > 0: nucleus filtering of every draw, vanilla's "
                        "and the verifier's (default 1: off); the tree for sampling is the "
                        "one stored for the temperature, measured without a filter")
    p.add_argument("--turns", default="first", choices=["first", "all"],
                   help="first (default): each question's first turn (the issue's 24 "
                        "prompts); all: Spec-Bench's protocol, MT-bench's second turns too, "
                        "asked after vanilla's answer to the first (reported per turn)")
    p.add_argument("--seed", type=int, default=0,
                   help="with --temperature > 0: the first prompt's seed, then one more a "
                        "prompt (default 0)")
    p.add_argument("--save-default-tree", action="store_true",
                   help="store the chosen tree and this run's head in the drafter's folder "
                        "(default_tree.json): generate then uses them when given none; at "
                        "--temperature > 0 (with --add-tree) the winner becomes the tree for "
                        "sampling, beside the greedy tree and head")
    p.add_argument("--out", default="results/bench_spec.json")


def config_from_args(args: argparse.Namespace) -> SpecBenchConfig:
    """The :class:`SpecBenchConfig` that :func:`add_spec_args`'s flags describe."""
    return SpecBenchConfig(resolve_model(args.model), args.drafter, per_task=args.per_task,
                           max_new_tokens=args.max_new_tokens, tree=tree_from_args(args),
                           grid=with_lookup([t for t in DEFAULT_GRID
                                             if t.num_nodes <= args.grid_max_nodes],
                                            args.tree_lookup, args.tree_lookup_min),
                           questions=args.questions, out=Path(args.out),
                           tasks=[t for t in args.tasks.split(",") if t],
                           eager_per_task=args.eager_per_task, dtype=args.dtype,
                           resume=not args.no_resume, vocab=args.vocab,
                           grid_add_default=args.grid_add_default, ab_trees=args.ab_trees,
                           ab_within=args.ab_within, ab_prompts=args.ab_prompts,
                           add_trees=tuple(TreeSpec.from_json_text(t, "--add-tree")
                                           for t in args.add_tree),
                           temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                           turns=args.turns)


def save_default_tree(result: dict[str, Any], drafter_dir: str | Path,
                      results_path: str | Path | None = None) -> Path:
    """Store the tree a ``bench spec`` run chose as the drafter's default
    (``<drafter_dir>/default_tree.json``, see :mod:`specjax.tree.default`), with what was
    measured: the candidates' estimates and paired speeds, the chosen tree's realised speed,
    the machine. A greedy run stores its tree and the head it drafted with; a sampled run
    whose paired A/B chose the tree stores it as the tree for sampling, beside the greedy
    default and its head (which both trees share).

    Raises:
      ValueError: the run did not choose its tree, drafted with a head that names an
        artifact outside the drafter folder (or, sampled, another head than the folder's),
        or found a greedy mismatch (a default must be lossless).
    """
    from specjax.tree.default import (
        check_portable_vocab,
        read_default_vocab,
        write_default_tree,
        write_sampled_default_tree,
    )

    conf = result["config"]
    greedy = conf.get("greedy", True)
    if greedy and conf.get("tree_mode") != "auto":
        raise ValueError("this run was given its tree; a default must be chosen by "
                         "measurement: run `specjax bench spec` without --tree")
    if not greedy and conf.get("tree_mode") != "paired":
        raise ValueError(f"this run sampled with a tree it did not choose ({conf['tree_mode']}"
                         "); give the trees to compare it with as --add-tree")
    vocab = check_portable_vocab(conf.get("vocab", "full"))
    if greedy and not result["greedy_equality"]["all_match"]:
        raise ValueError("greedy output differed from vanilla in this run; not saving a "
                         "default from it")
    sel = result["tree_selection"]
    ab = sel.get("ab")
    paired = None if not ab or "results" not in ab else {
        r["label"]: {"speed_vs_first": round(r["vs_first"]["ratio"], 4),
                     "ci95": [round(x, 4) for x in r["vs_first"]["ci95"]]}
        for r in ab["results"]}
    measured = {
        "chosen": result["tree_label"], "paired": paired,
        "realized_speedup": result["overall"]["speedup"],
        "speedup_ci95": result["overall"].get("speedup_ci95"),  # absent before the 75th session
        "mal": result["overall"]["mal"],
        "prompts": result["overall"]["prompts"], "model": conf["model"],
        "machine": {k: result["machine"].get(k) for k in ("cpu_model", "nproc", "jax_backend",
                                                          "versions")},
        "results": None if results_path is None else str(results_path),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    rule = "the fastest wins, or at a speed tie the higher MAL where resolved"
    tree = TreeSpec.from_json(result["tree"])
    if not greedy:
        stored = read_default_vocab(drafter_dir)
        if stored != vocab:
            raise ValueError(f"this run drafted with the head {vocab!r}, but the drafter's "
                             f"trees share {stored!r}; run again with --vocab {stored}")
        how = (f"bench spec --temperature {conf['temperature']:g}: the {len(ab['candidates'])}"
               f" trees run end to end at that temperature, paired, on {ab['prompts']} "
               f"calibration prompts: {rule} ({ab['decided_by']})")
        return write_sampled_default_tree(drafter_dir, tree, {"how": how, **measured},
                                          temperature=conf["temperature"])
    how = "bench spec: calibration MAL / (verify(T) + draft time), highest wins"
    if paired is not None:
        how += (f"; then the {len(ab['candidates'])} best within {ab['within']:.0%} run end "
                f"to end, paired, on {ab['prompts']} calibration prompts: {rule} "
                f"({ab['decided_by']})")
    measured = {"how": how, **measured, "est_speedup": sel["chosen"]["est_speedup"],
                "candidates": {c["label"]: round(c["est_speedup"], 4) for c in sel["grid"]}}
    return write_default_tree(drafter_dir, tree, measured, vocab=vocab)


def run_spec_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Run :func:`run_spec_bench` from :func:`add_spec_args`'s flags."""
    # What --save-default-tree would refuse after the run is refused before it.
    if args.save_default_tree and args.drafter == "random":
        raise ValueError("--save-default-tree needs a trained drafter, not 'random'")
    if args.save_default_tree and args.temperature > 0 and not args.add_tree:
        raise ValueError("--save-default-tree at --temperature > 0 stores the tree for sampling "
                         "that a paired A/B chose: give the trees to compare the current one "
                         "with as --add-tree")
    if args.save_default_tree and args.top_p < 1:
        raise ValueError("--save-default-tree stores trees by temperature alone, measured "
                         "without a top-p filter; drop --top-p to choose one")
    if args.save_default_tree and args.vocab is not None:
        from specjax.tree.default import check_portable_vocab

        check_portable_vocab(args.vocab)
    res = run_spec_bench(config_from_args(args))
    if args.save_default_tree:
        where = save_default_tree(res, res["config"]["drafter"], args.out)
        what = ("default tree" if res["config"]["greedy"] else "tree for sampling")
        print(f"{what} {res['tree_label']} (head {res['config']['vocab']}) saved to {where}")
    return res


def add_parser(bench: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``spec`` to ``specjax bench``'s subparsers; ``args.run`` runs it."""
    p = bench.add_parser("spec",
                         help="Spec-Bench subset: MAL, speedup, greedy equality (JSON + plot)")
    add_spec_args(p)
    p.set_defaults(run=as_command(run_spec_from_args))
    return p
