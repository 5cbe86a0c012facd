"""``specjax bench spec``: Spec-Bench-style evaluation of speculative decoding on this machine.

One command, one run, one JSON + one PNG:

1. **Tree budget from measured latency.** A verify forward over T tokens costs little more
   than one over a single token only while the matrix products stay bandwidth bound; on a
   2-core CPU that stops early (measured here: a 60-token tree costs ~170 ms, a token ~24 ms).
   So the run measures the target's forward latency (jitted ``forward_hidden`` +
   ``lm_head`` + argmax, B=1, a cache as long as the evaluation's) for T = 1..32 tokens,
   measures the drafter's whole draft phase for each candidate tree of a small grid, takes
   each tree's MAL from a calibration run on a few ShareGPT prompts (never Spec-Bench's:
   :func:`specjax.bench.questions.calibration_prompts`) over the evaluation's budget of
   new tokens, and picks the tree maximising ``MAL / (verify_latency(T) + draft_time)``.
   That estimate cannot order trees within a few percent of each other (its calibration
   is a few prompts);
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

The tree choice (the estimate, the paired A/B) is in :mod:`~specjax.bench.spec_select`, a
prompt's decoding and the pooled figures in :mod:`~specjax.bench.spec_records`, the printed
table and the plot in :mod:`~specjax.bench.spec_report`, the flags and saving the chosen tree
in :mod:`~specjax.bench.spec_cli`. The pieces this run shares
with the other benchmarks live beside it: the questions in
:mod:`~specjax.bench.questions`, timing and the latency curve in
:mod:`~specjax.bench.timing`, the draft phase and drafters in :mod:`~specjax.bench.phases`,
tree flags and names in :mod:`~specjax.bench.trees`, the partial file in
:mod:`~specjax.bench.partial`.
"""

from __future__ import annotations

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

from specjax.bench.common import (
    MAL_NOTE,
    check_sampling,
    jsonable,
    machine_info,
    write_json,
)
from specjax.bench.partial import append_record, drafter_stamp, resume_from
from specjax.bench.phases import load_models
from specjax.bench.questions import (
    CALIB_PROMPTS,
    TASKS,
    calibration_prompts,
    spec_bench_prompts,
)
from specjax.bench.spec_records import (
    PromptRunner,
    aggregate,
    follow_up,
    run_turn,
    turn_count,
)
from specjax.bench.spec_report import SAMPLING_NOTE, plot_spec, summary
from specjax.bench.spec_select import (
    AB_LONG_SHARE,
    AB_MAX_PROMPT_TOKENS,
    ab_prompts,
    paired_ab,
    select_tree,
    tie_break,
)
from specjax.bench.timing import cache_geometry, latency_curve
from specjax.bench.trees import tree_dict, tree_label
from specjax.loaded import Drafter, Target
from specjax.speculative import TreeSpec, spare_rows
from specjax.tree.default import nearest_temperature, stored_greedy_trees
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
        :func:`specjax.bench.questions.calibration_prompts`) and their budget (None:
        ``max_new_tokens``, as the A/B and the evaluation decode). A shorter budget
        under-counts the lookup chain, which copies more the longer a greedy answer runs
        (eighty-eighth session: at 48 tokens Gemma 3's chain d1 + lookup 8 counted MAL 2.37
        and 3.81 at 128; the estimate ranked it last of three, the A/B first).
      latency_sizes: T values of the latency curve (every tree's node count is added).
      runs: timed repeats of each micro-benchmark (after one untimed compile call).
      stop_on_eos: whether EOS ends a prompt's generation before ``max_new_tokens``.
      dtype: cast the target's parameters at load ("float32", "bfloat16"; None: as stored).
      resume: reuse matching records of an interrupted run's partial file.
      vocab: the drafter's vocabulary head spec ("full", "fr:8192", "dynaspec", ...; see
        :func:`specjax.vocab.resolve_head`) or a built head, used for calibration, draft
        timing and evaluation; None: the drafter's measured default head, else full.
        Verification is always over the full vocabulary.
      grid_add_default: also consider the drafter's stored greedy trees (its
        ``default_tree.json``'s main tree and each machine class's; a static tree, say,
        which the grid lacks), so a run can say whether the shipped default still wins on
        this machine; with ``ab_trees`` they always run in the paired A/B.
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
    calib_max_new_tokens: int | None = None
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
        if self.calib_max_new_tokens is not None and self.calib_max_new_tokens < 1:
            raise ValueError(f"calib_max_new_tokens is None (max_new_tokens) or >= 1, got "
                             f"{self.calib_max_new_tokens}")
        check_sampling(self.temperature, self.top_p)
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

    @property
    def calib_new_tokens(self) -> int:
        """The calibration's budget of new tokens: ``calib_max_new_tokens``, else the
        evaluation's."""
        return self.calib_max_new_tokens or self.max_new_tokens


def candidates(cfg: SpecBenchConfig, drafter: Drafter,
               drafter_name: str) -> tuple[tuple[TreeSpec, ...], list[int]]:
    """(the trees a run considers, the indices among them that always run in a paired A/B).

    Greedy: the grid (or the given tree), then ``add_trees`` and with ``grid_add_default``
    the drafter's stored greedy trees (this machine's, then every other its folder stores),
    each once; those added always run. At temperature > 0:
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
            if drafter.path is not None:
                added.extend(stored_greedy_trees(drafter.path))
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
                            calib_max_new_tokens=cfg.calib_new_tokens,
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
                   "calib_max_new_tokens": cfg.calib_new_tokens, "latency_sizes": sizes,
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
    n_steps = sum(map(turn_count, evals)) + len(eager_qids)
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

    runner = PromptRunner(target, drafter, chosen_tree, max_new_tokens, stop_on_eos, head,
                     cfg.temperature, cfg.top_p)
    records = []
    for i, p in enumerate(evals):
        qid, ids, answers = p["question_id"], p["ids"], []
        for turn in range(1, turn_count(p) + 1):
            if turn > 1:  # the conversation so far, answered by vanilla (the target)
                ids = follow_up(target, p, ids, answers)
            eager = qid in eager_qids and turn == 1
            if (qid, turn) in done:
                rec = done[(qid, turn)]
                bar.update(2 if eager else 1)
            else:
                # One seed a prompt, shared by its methods (it does not matter when greedy).
                rec = run_turn(runner, p, ids, turn, seed=cfg.seed + i + len(evals) * (
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
