"""``specjax bench batch``: speculative decoding's speedup against the batch size.

Speculative decoding pays where a decode step is bound by reading the weights: verifying T
tree nodes then costs little more than decoding one token. A batch of B requests already
shares that read among B rows, and a tree multiplies the rows again (B x T in one verify
forward), so the step turns compute-bound sooner and the speedup shrinks as B grows; the
tree that is fastest at batch 1 (which ``bench spec`` chooses and ``generate`` drafts by
default) need not be at batch 8. This run measures where.

On the Spec-Bench prompts of ``bench spec`` (the first ``per_task`` questions of each task,
first turns, chat template, greedy), interleaved by task so that each batch mixes tasks as
a server's does, and cut into batches of B: for every batch size and every batch, vanilla
decoding and each tree (default: the drafter's measured greedy tree, a chain of one
draft and the trees of its batch defaults), each batch decoding until all its rows stop
(EOS or the budget: static batching, the same for every method). Reported for each (B,
tree): decode tokens/s against vanilla's over the same batches, the speedup with a 95%
interval that resamples batches (paired), MAL, and greedy equality row by row (every row
must match vanilla's).

``--calibration N`` runs on N calibration prompts instead (ShareGPT, Spec-Bench's mix of
lengths, never its questions: the prompts of ``bench spec``'s paired A/Bs, interleaved by
kind), and only such a run can be saved: a default is chosen off the evaluation.
``--save-default-tree`` stores what the run found as the drafter's batch defaults
(:func:`specjax.tree.default.write_batch_trees`): for each measured B >= 2 the fastest tree
among those resolved faster than vanilla decoding there, or vanilla decoding where none
was and at every larger size; ``generate`` then drafts that tree for a batch of that
size, or decodes without the drafter (``disable_by_batch_size``).

``--temperature T`` (> 0) measures sampled batches instead (default trees: the drafter's
tree for sampling at T, a chain of one draft, and the trees of its greedy batch defaults
and of its sampled ones nearest T): vanilla and every tree draw with one seed a
batch (``--seed`` + its index), no EOS stop (every row runs the budget, so the methods
decode the same number of tokens), and no equality is counted. Saved, such a run's choice
becomes the sampled batch defaults at T, which sampling drafts at the temperatures nearer T
than any other measured one (as the trees for sampling at batch 1 are chosen); a lookup
chain accepted at greedy batches is accepted less the higher the temperature, so the
choice moves with it. ``--top-p P`` filters every draw of a sampled run (vanilla's and the
verifier's alike); the defaults are keyed by temperature alone, so such a run measures but
is not saved.

Per-batch results go to ``<out stem>.partial.jsonl``; a rerun skips those done, and those of
a finished run at ``--out`` with the same settings (batch sizes aside): adding a size to a
finished run measures only that size.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

import specjax
from specjax.bench.common import (
    as_command,
    check_sampling,
    dash,
    first_mismatch,
    machine_info,
    paired_speedup,
    pyplot,
    sampling_label,
    save_figure,
    write_json,
)
from specjax.bench.partial import append_record, drafter_stamp, resume_from
from specjax.bench.phases import load_models
from specjax.bench.questions import QUESTIONS_ENV, TASKS, spec_bench_prompts
from specjax.bench.spec_select import ab_prompt_records
from specjax.bench.timing import count_compiles, ensure_warm, warmup_tokens
from specjax.bench.trees import tree_label
from specjax.defaults import resolve_model
from specjax.loaded import Drafter, Target
from specjax.loop import bucket
from specjax.speculative import TreeSpec
from specjax.vocab.head import VocabHead
from specjax.vocab.resolve import resolve_head

BATCH_SIZES = (1, 2, 4, 8)


@dataclasses.dataclass(frozen=True)
class BatchBenchConfig:
    """The settings of one ``specjax bench batch`` run.

    Attributes:
      model_dir: a converted target folder.
      drafter_dir: a drafter folder; None for the shipped one; "random" for an untrained
        drafter (pipeline check only).
      batch_sizes: the B values, each >= 1.
      trees: the draft trees compared; empty: the drafter's measured greedy tree (its
        ``default_tree.json``, else :class:`TreeSpec`'s defaults) and a chain of one draft.
      vocab: the drafter's head spec; None: the drafter's measured head, else full.
      per_task, tasks, questions: the Spec-Bench prompts, as ``bench spec`` takes them.
      calibration: > 0: that many calibration prompts instead (their kinds as tasks).
      max_new_tokens: the budget of every row (EOS also stops a row, greedy).
      temperature, seed: 0 greedy; > 0 sampled, the batch of index k drawn with seed + k by
        vanilla and every tree alike, without the EOS stop.
      top_p: the nucleus mass every sampled draw keeps (1 = off; < 1 needs temperature > 0).
      out: JSON path; the PNG goes beside it.
      resume: reuse matching records of an interrupted run's partial file, or of a finished
        run at ``out`` with the same settings but other batch sizes.
    """

    model_dir: str | Path
    drafter_dir: str | Path | None = None
    batch_sizes: Sequence[int] = BATCH_SIZES
    trees: Sequence[TreeSpec] = ()
    vocab: str | None = None
    per_task: int = 4
    tasks: Sequence[str] = TASKS
    questions: str | Path | None = None
    calibration: int = 0
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    out: str | Path = "results/bench_batch.json"
    resume: bool = True

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {list(self.batch_sizes)}")
        if self.calibration < 0:
            raise ValueError(f"calibration takes a number of prompts >= 0, got "
                             f"{self.calibration}")
        check_sampling(self.temperature, self.top_p)
        if self.per_task < 1 or self.max_new_tokens < 1:
            raise ValueError("need per_task >= 1 and max_new_tokens >= 1")


def interleave(prompts: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``prompts`` (grouped by task) reordered round-robin over the tasks, so that a batch
    cut from the front mixes tasks (and prompt lengths) as a server's batch does."""
    by_task: dict[str, list[dict[str, Any]]] = {}
    for p in prompts:
        by_task.setdefault(p["task"], []).append(p)
    queues = list(by_task.values())
    out = []
    for i in range(max(map(len, queues), default=0)):
        out += [q[i] for q in queues if i < len(q)]
    return out


def batches(prompts: Sequence[dict[str, Any]], b: int) -> list[list[dict[str, Any]]]:
    """``prompts`` in consecutive batches of ``b`` (the last one smaller where ``b`` does not
    divide their number)."""
    return [list(prompts[i:i + b]) for i in range(0, len(prompts), b)]


def default_trees(drafter: Drafter, temperature: float = 0.0) -> list[TreeSpec]:
    """The drafter's measured tree at ``temperature`` (what ``generate`` drafts by default
    at batch 1), the smallest tree (a chain of one draft), and the incumbents: the trees of
    the batch table that serves ``temperature`` and, sampling, of the greedy one (a tree
    that pays at greedy batches may at a low temperature too), each once."""
    out = [drafter.tree_for(temperature), TreeSpec("chain", depth=1)]
    tables = [drafter.batch_table(temperature)] + ([drafter.batch_trees] if temperature
                                                   else [])
    out += [tree for table in tables for _, tree in table if tree is not None]
    return list(dict.fromkeys(out))


class _Runner:
    """Runs one method on one batch, compiling each (method, B, prompt bucket) untimed first."""

    def __init__(self, target: Target, drafter: Drafter, head: VocabHead, max_new_tokens: int,
                 temperature: float = 0.0, top_p: float = 1.0):
        self.target, self.drafter, self.head = target, drafter, head
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.warm: set[tuple[str, int, int]] = set()

    def __call__(self, tree: TreeSpec | None, ids: list[list[int]],
                 seed: int = 0) -> dict[str, Any]:
        kw: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p,
                              "seed": seed, "stop_on_eos": self.temperature == 0}
        if tree is not None:
            kw |= {"drafter": self.drafter, "tree": tree, "vocab": self.head}
        key = ("vanilla" if tree is None else tree_label(tree), len(ids),
               bucket(max(map(len, ids))))
        ensure_warm(self.warm, key, lambda: specjax.generate(
            self.target, ids, max_new_tokens=warmup_tokens(self.max_new_tokens), **kw))
        with count_compiles() as n:
            res = specjax.generate(self.target, ids, max_new_tokens=self.max_new_tokens, **kw)
        s = res.stats
        rec = {"tokens": res.tokens, "decode_s": s["decode_s"], "wall_s": s["wall_s"],
               # Decoded tokens (each row's first comes from the prefill), + 1 so that
               # paired_speedup's per-record "new_tokens - 1" counts them.
               "new_tokens": s["new_tokens"] - len(ids) + 1, "compiles_while_timed": n[0]}
        if tree is not None:
            rec |= {"target_forwards": s["target_forwards"],
                    "accepted_tokens": sum(map(sum, s["accept_lengths"]))}
        return rec


def pooled(records: Sequence[dict[str, Any]], label: str) -> dict[str, Any]:
    """One (B, tree)'s figures over its batches: decode tokens/s, the speedup against
    vanilla on the same batches with its interval, MAL (bonus token included) and the rows
    equal to vanilla's."""
    runs = [r[label] for r in records]
    tokens = sum(x["new_tokens"] - 1 for x in runs)
    vanilla = [r["vanilla"] for r in records]
    v_rate = sum(x["new_tokens"] - 1 for x in vanilla) / sum(x["decode_s"] for x in vanilla)
    rate = tokens / sum(x["decode_s"] for x in runs)
    sp = paired_speedup(vanilla, runs)
    fwd = sum(x["target_forwards"] for x in runs)
    return {"decode_tokens_per_s": rate, "vanilla_decode_tokens_per_s": v_rate,
            "speedup": rate / v_rate, "speedup_ci95": None if sp is None else sp["ci95"],
            "mal": sum(x["accepted_tokens"] for x in runs) / fwd if fwd else None,
            "rows": sum(len(x["tokens"]) for x in runs),
            # Sampled runs count no equality (None): their draws differ from vanilla's.
            "rows_equal": None if "mismatches" not in runs[0]
            else sum(m is None for x in runs for m in x["mismatches"]),
            "batches": len(runs)}


def run_batch_bench(cfg: BatchBenchConfig, *, prompts: Sequence[dict[str, Any]] | None = None,
                    drafter: Drafter | None = None) -> dict[str, Any]:
    """Run the comparison; writes ``cfg.out`` (JSON), a PNG beside it, and returns the result.

    Args:
      cfg: the run's settings.
      prompts, drafter: internal (tests): pre-tokenised prompts ``{"question_id", "task",
        "ids"}`` instead of Spec-Bench's, an already loaded drafter.
    """
    out = Path(cfg.out)
    target, drafter, drafter_name = load_models(cfg.model_dir, None, drafter, cfg.drafter_dir)
    vocab = cfg.vocab or drafter.default_vocab or "full"
    head = resolve_head(vocab, target, drafter)
    greedy = cfg.temperature == 0
    trees = list(cfg.trees) or default_trees(drafter, cfg.temperature)
    labels = [tree_label(t) for t in trees]
    calib = None
    if cfg.calibration:
        evals, calib = ab_prompt_records(target, cfg.calibration, questions=cfg.questions,
                                         given=prompts)
        qpath = None
    else:
        evals, qpath = spec_bench_prompts(target, questions=cfg.questions, tasks=cfg.tasks,
                                          per_task=cfg.per_task, prompts=prompts)
    order = interleave(evals)
    config = json.loads(json.dumps({
        "model": str(cfg.model_dir), "drafter": drafter_name, "vocab": vocab,
        "batch_sizes": list(cfg.batch_sizes), "trees": [t.to_json() for t in trees],
        "labels": labels, "per_task": cfg.per_task, "tasks": list(cfg.tasks),
        "max_new_tokens": cfg.max_new_tokens, "greedy": greedy, "stop_on_eos": greedy,
        **({} if greedy else {"temperature": cfg.temperature, "seed": cfg.seed}),
        # Only where it filters, so that earlier runs' resume keys stay valid.
        **({} if cfg.top_p == 1 else {"top_p": cfg.top_p}),
        "questions": None if qpath is None else str(qpath),
        **({} if calib is None else {"calibration": calib}),
        "prompts": [p["question_id"] for p in order]}))
    # A batch's record depends on its size and index, not on which other sizes the run
    # measures: the key leaves the sizes out, so a run with more sizes reuses the others'.
    key = json.dumps({k: v for k, v in config.items() if k != "batch_sizes"}
                     | {"drafter_mtime": drafter_stamp(drafter)}, sort_keys=True)
    resume_key = hashlib.sha256(key.encode()).hexdigest()[:16]
    ppath, old = resume_from(out, cfg.resume)
    if cfg.resume:
        old = finished_records(out, resume_key, key) + old
    done = {(r["b"], r["batch"]): r for r in old if r.get("key") == key}

    runner = _Runner(target, drafter, head, cfg.max_new_tokens, cfg.temperature, cfg.top_p)
    plan = [(b, k, batch) for b in cfg.batch_sizes for k, batch in enumerate(batches(order, b))]
    records = []
    t0 = time.perf_counter()
    for b, k, batch in tqdm(plan, desc="bench batch", unit="batch"):
        if (b, k) in done:
            records.append(done[(b, k)])
            continue
        t_batch = time.perf_counter()
        ids = [p["ids"] for p in batch]
        rec: dict[str, Any] = {"key": key, "b": b, "batch": k,
                               "question_ids": [p["question_id"] for p in batch],
                               "vanilla": runner(None, ids, cfg.seed + k)}
        for label, tree in zip(labels, trees, strict=True):
            rec[label] = runner(tree, ids, cfg.seed + k)
            if not greedy:
                continue
            rec[label]["mismatches"] = [first_mismatch(s, v) for s, v in zip(
                rec[label]["tokens"], rec["vanilla"]["tokens"], strict=True)]
            for q, m in zip(rec["question_ids"], rec[label]["mismatches"], strict=True):
                if m is not None:
                    tqdm.write(f"!!! GREEDY MISMATCH: {label} at batch size {b}, question {q}: "
                               f"differs from vanilla at new token {m} !!!")
        # The batch's whole cost (its untimed compiles too), so that a run assembled from
        # earlier invocations still adds up to what it took.
        rec["measure_s"] = time.perf_counter() - t_batch
        append_record(ppath, rec)
        records.append(rec)

    by_b = {str(b): {label: pooled([r for r in records if r["b"] == b], label)
                     for label in labels} for b in cfg.batch_sizes}
    result = {
        "benchmark": "batch", "config": config, "resume_key": resume_key,
        "machine": machine_info(),
        "by_batch_size": by_b,
        # None sampled: nothing to compare token for token.
        "all_rows_equal": None if not greedy else all(
            x["rows_equal"] == x["rows"] for row in by_b.values() for x in row.values()),
        "timed_compiles": sum(r[m]["compiles_while_timed"] for r in records
                              for m in ("vanilla", *labels)),
        # The time measuring every batch took, reused ones included (older result files'
        # records carry none), and then this invocation's alone.
        "measure_s": sum(r.get("measure_s", 0.0) for r in records),
        "wall_s": time.perf_counter() - t0,
        "batches_reused": sum((b, k) in done for b, k, _ in plan),
        "per_batch": [{k: v for k, v in r.items() if k != "key"} for r in records],
    }
    write_json(out, result)
    plot_batch(result, out.with_suffix(".png"))
    ppath.unlink(missing_ok=True)
    print(summary(result))
    return result


def finished_records(out: Path, resume_key: str, key: str) -> list[dict[str, Any]]:
    """The per-batch records of a finished run at ``out`` whose settings and drafter are this
    run's (its ``resume_key``), keyed as partial records are; [] otherwise. A finished run
    removes its partial file, and this lets a rerun with more batch sizes measure only them.
    """
    try:
        r = json.loads(out.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(r, dict) or r.get("resume_key") != resume_key:
        return []
    return [rec | {"key": key} for rec in r.get("per_batch", [])]


def batch_choice(r: dict[str, Any]) -> dict[int, int | None]:
    """For each measured batch size B >= 2, the index (into ``r["config"]["trees"]``) of the
    fastest tree among those whose speedup interval lies above 1, or None where no tree was
    resolved faster than vanilla decoding (a tie decodes without the drafter: no slower,
    and nothing to draft), and None at every size above such a one.

    Why the last rule: a verify of rows x nodes only grows more compute-bound with the rows,
    so speculation's gain falls with the batch size; a win measured above a size where it
    lost is read as noise (a large size has few batches: 23 prompts make 3 of 8 rows), and
    ``generate`` then switches the drafter off once, not on and off again.
    """
    labels = r["config"]["labels"]
    out: dict[int, int | None] = {}
    lost = False
    for b, row in sorted(r["by_batch_size"].items(), key=lambda kv: int(kv[0])):
        if int(b) < 2:
            continue
        faster = [i for i, label in enumerate(labels) if row[label]["speedup_ci95"] is not None
                  and row[label]["speedup_ci95"][0] > 1.0]
        best = max(faster, key=lambda i: row[labels[i]]["speedup"], default=None)
        out[int(b)] = None if lost else best
        lost = lost or best is None
    return out


def save_batch_defaults(r: dict[str, Any], drafter_dir: str | Path,
                        results_path: str | Path | None = None) -> Path:
    """Store :func:`batch_choice` of a run as the drafter's batch defaults, with what was
    measured (every tree's speedup and interval at every batch size, the machine).

    A greedy run stores the batch defaults, a sampled one (``--temperature T``) the sampled
    batch defaults at T (those at other temperatures stay).

    Raises:
      ValueError: a row differed from vanilla's output (greedy), the run measured no batch
        size of 2 or more, it drafted with another head than the folder's trees share, or
        an unmeasured size would draft a tree measured at another size
        (:func:`specjax.tree.default.unmeasured_drafting_sizes`).
    """
    from specjax.tree.default import read_default_vocab, write_batch_trees

    greedy = r["config"]["greedy"]
    if not r["config"].get("calibration"):
        raise ValueError("batch defaults are chosen on calibration prompts, never on "
                         "Spec-Bench's (the evaluation): run again with --calibration 24")
    if greedy and not r["all_rows_equal"]:
        raise ValueError("a row differed from vanilla's greedy output in this run; not "
                         "saving batch defaults from it")
    if r["config"].get("top_p", 1.0) < 1:
        raise ValueError("the sampled batch defaults are keyed by temperature alone and "
                         "chosen without a top-p filter; run again without --top-p to "
                         "choose them")
    choice = batch_choice(r)
    if not choice:
        raise ValueError("the run measured no batch size of 2 or more; add one to "
                         "--batch-sizes")
    stored = read_default_vocab(drafter_dir)
    if stored is not None and stored != r["config"]["vocab"]:
        raise ValueError(f"this run drafted with the head {r['config']['vocab']!r}, but the "
                         f"drafter's trees share {stored!r}; run again with --vocab {stored}")
    trees = [TreeSpec.from_json(t) for t in r["config"]["trees"]]
    measured = {
        "how": ("bench batch --calibration: calibration prompts (ShareGPT, never Spec-Bench) "
                "in batches mixing kinds; per batch size the fastest tree resolved faster "
                "than vanilla decoding (95% interval over batches, paired), else vanilla "
                "decoding there and at every larger size; above the largest size "
                "measured, vanilla decoding"),
        "chosen": {str(b): label for b, label in batch_choice_labels(r).items()},
        "speedups": {b: {label: {"speedup": round(x["speedup"], 4),
                                 "ci95": None if x["speedup_ci95"] is None
                                 else [round(c, 4) for c in x["speedup_ci95"]]}
                         for label, x in row.items()}
                     for b, row in r["by_batch_size"].items()},
        "machine": {k: r["machine"].get(k) for k in ("cpu_model", "nproc", "jax_backend",
                                                     "versions")},
        **({} if greedy else {"temperature": r["config"]["temperature"],
                              "seed": r["config"]["seed"]}),
        "results": None if results_path is None else str(results_path),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    return write_batch_trees(drafter_dir, {b: None if i is None else trees[i]
                                           for b, i in choice.items()}, measured,
                             temperature=0.0 if greedy else r["config"]["temperature"])


def summary(r: dict[str, Any]) -> str:
    """A markdown table: one row per (batch size, tree)."""
    lines = ["| B | tree | vanilla tok/s | spec tok/s | speedup [95%] | MAL | rows equal |",
             "|---|---|---|---|---|---|---|"]
    for b, row in r["by_batch_size"].items():
        for label, x in row.items():
            ci = x["speedup_ci95"]
            sp = f"{x['speedup']:.2f}x" + ("" if ci is None else f" [{ci[0]:.2f}, {ci[1]:.2f}]")
            lines.append(f"| {b} | {label} | {x['vanilla_decode_tokens_per_s']:.1f} | "
                         f"{x['decode_tokens_per_s']:.1f} | {sp} | {dash(x['mal'])} | "
                         f"{'-' if x['rows_equal'] is None else x['rows_equal']}/{x['rows']} |")
    lines.append("MAL = tokens committed per target forward, the bonus token included; rates "
                 "are decode tokens/s of the whole batch")
    if r["timed_compiles"]:
        lines.append(f"warning: {r['timed_compiles']} XLA compiles inside timed calls")
    if not r["config"]["greedy"]:
        lines.append(f"sampled at {_how(r)} (batch k: seed {r['config']['seed']} + k, shared "
                     "by every method), no EOS stop: no row is compared with vanilla's")
    elif not r["all_rows_equal"]:
        lines.append("!!! some rows differ from vanilla's greedy output (see per_batch) !!!")
    return "\n".join(lines)


def plot_batch(r: dict[str, Any], path: Path) -> Path:
    """Speedup against B per tree, with its interval (left); decode tokens/s against B for
    vanilla and each tree (right)."""
    plt = pyplot()
    bs = [int(b) for b in r["by_batch_size"]]
    labels = r["config"]["labels"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.6))
    for label in labels:
        xs = [r["by_batch_size"][str(b)][label] for b in bs]
        sp = [x["speedup"] for x in xs]
        lo = [x["speedup"] - (x["speedup_ci95"] or [x["speedup"]] * 2)[0] for x in xs]
        hi = [(x["speedup_ci95"] or [x["speedup"]] * 2)[1] - x["speedup"] for x in xs]
        ax.errorbar(bs, sp, yerr=[lo, hi], marker="o", capsize=3, label=label)
        bx.plot(bs, [x["decode_tokens_per_s"] for x in xs], marker="o", label=label)
    first = r["by_batch_size"][str(bs[0])][labels[0]]
    bx.plot(bs, [r["by_batch_size"][str(b)][labels[0]]["vanilla_decode_tokens_per_s"]
                 for b in bs], marker="s", color="black", label="vanilla")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    for a, ylabel in ((ax, "speedup over vanilla (95% interval)"),
                      (bx, "decode tokens/s, whole batch")):
        a.set_xscale("log", base=2)
        a.set_xticks(bs, [str(b) for b in bs])
        a.set_xlabel("batch size")
        a.set_ylabel(ylabel)
        a.legend(fontsize=8)
    ax.set_title(f"{_how(r)}, {r['config']['max_new_tokens']} tokens a row; vanilla at B="
                 f"{bs[0]}: {first['vanilla_decode_tokens_per_s']:.1f} tok/s", fontsize=9)
    return save_figure(fig, path)


def _how(r: dict[str, Any]) -> str:
    """How a run decoded: "greedy", "temperature T" or "temperature T, top-p P"."""
    return "greedy" if r["config"]["greedy"] else f"temperature {sampling_label(r['config'])}"


def add_batch_args(p: argparse.ArgumentParser) -> None:
    """Attach ``specjax bench batch``'s flags to a (sub)parser."""
    p.add_argument("--model", default=None, help="converted target (default: SmolLM2)")
    p.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one)")
    p.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)),
                   help="comma-separated batch sizes (default 1,2,4,8)")
    p.add_argument("--tree-json", action="append", default=[], metavar="JSON",
                   help="a tree to compare, as TreeSpec JSON (repeat for more; default: the "
                        "drafter's measured greedy tree, a chain of one draft and the trees of "
                        "its batch defaults)")
    p.add_argument("--vocab", default=None,
                   help="drafter vocabulary head (default: the drafter's measured head)")
    p.add_argument("--per-task", type=int, default=4)
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--calibration", type=int, default=0, metavar="N",
                   help="run on N calibration prompts (ShareGPT, Spec-Bench's mix of lengths, "
                        "never its questions) instead of Spec-Bench's; --save-default-tree "
                        "needs it")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--questions", default=None,
                   help=f"Spec-Bench question.jsonl (default: ${QUESTIONS_ENV}, else "
                        "../shared/data/spec_bench/question.jsonl)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 (default): greedy, every row checked against vanilla's; > 0: "
                        "sampled, one seed a batch shared by vanilla and every tree, no EOS "
                        "stop (default trees: the drafter's tree for sampling at T, a chain, and "
                        "the trees of its batch defaults)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="with --temperature > 0: keep the smallest set of ids holding P of "
                        "each draw's mass (default 1: off); such a run is not saved")
    p.add_argument("--seed", type=int, default=0,
                   help="with --temperature > 0: the first batch's seed (default 0)")
    p.add_argument("--no-resume", action="store_true",
                   help="measure every batch again: ignore (and remove) an interrupted "
                        "run's partial results and a finished run's at --out")
    p.add_argument("--save-default-tree", action="store_true",
                   help="store, for each batch size >= 2, the fastest tree resolved faster "
                        "than vanilla decoding there (or vanilla decoding where none was, and "
                        "at every larger size) in the drafter's default_tree.json: generate "
                        "then follows it (with --temperature T: when sampling at the "
                        "temperatures nearer T than any other measured)")
    p.add_argument("--out", default="results/bench_batch.json")


def run_batch_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Run :func:`run_batch_bench` from :func:`add_batch_args`' flags (and save)."""
    if args.save_default_tree and args.drafter == "random":
        raise ValueError("--save-default-tree needs a trained drafter, not 'random'")
    if args.save_default_tree and args.top_p < 1:
        raise ValueError("--save-default-tree chooses the sampled batch defaults at a "
                         "temperature, without a top-p filter; drop --top-p to choose them")
    if args.save_default_tree and not args.calibration:
        raise ValueError("--save-default-tree chooses on calibration prompts, never on "
                         "Spec-Bench's (the evaluation): add --calibration 24")
    cfg = config_from_args(args)
    if args.save_default_tree:
        from specjax.tree.default import unmeasured_drafting_sizes

        # Before the run, as if every size drafted: a gap is refused at saving only where
        # the size below it turns out to draft, which the run has yet to tell.
        if gaps := unmeasured_drafting_sizes({b: True for b in cfg.batch_sizes if b >= 2}):
            print(f"note: batch sizes {gaps} are not measured; saving is refused if a size "
                  "below one of them drafts a tree (add them to --batch-sizes)")
    r = run_batch_bench(cfg)
    if args.save_default_tree:
        where = save_batch_defaults(r, r["config"]["drafter"], args.out)
        chosen = ", ".join(f"B={b}: {t or 'vanilla decoding'}"
                           for b, t in batch_choice_labels(r).items())
        kind = "batch" if r["config"]["greedy"] else "sampled batch"
        print(f"{kind} defaults ({chosen}) saved to {where}")
    return r


def batch_choice_labels(r: dict[str, Any]) -> dict[int, str | None]:
    """:func:`batch_choice` with the trees' labels."""
    labels = r["config"]["labels"]
    return {b: None if i is None else labels[i] for b, i in batch_choice(r).items()}


def config_from_args(args: argparse.Namespace) -> BatchBenchConfig:
    """The :class:`BatchBenchConfig` that :func:`add_batch_args`' flags describe."""
    try:
        sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    except ValueError:
        raise ValueError(f"--batch-sizes takes integers separated by commas, got "
                         f"{args.batch_sizes!r}") from None
    return BatchBenchConfig(
        resolve_model(args.model), args.drafter, batch_sizes=sizes,
        trees=tuple(TreeSpec.from_json_text(t, "--tree-json") for t in args.tree_json),
        vocab=args.vocab, per_task=args.per_task, tasks=[t for t in args.tasks.split(",") if t],
        questions=args.questions, calibration=args.calibration,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, seed=args.seed, out=Path(args.out),
        resume=not args.no_resume)


def add_parser(bench: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``batch`` to ``specjax bench``'s subparsers; ``args.run`` runs it."""
    p = bench.add_parser(
        "batch", help="speculative speedup against the batch size (greedy or sampled)")
    add_batch_args(p)
    p.set_defaults(run=as_command(run_batch_from_args))
    return p
