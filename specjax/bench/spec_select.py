"""``specjax bench spec``'s tree choice: each candidate's speed estimated from a latency
curve and a calibration run (:func:`select_tree`), and the estimate's near-ties (or given
trees) run end to end, paired, to choose among them (:func:`paired_ab`, :func:`tie_break`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

import specjax
from specjax.bench.common import MAL_NOTE
from specjax.bench.paired import choose, paired_runs, relative_speed
from specjax.bench.phases import draft_latency
from specjax.bench.questions import calibration_prompts
from specjax.bench.timing import interp_latency
from specjax.bench.trees import tree_dict, tree_label
from specjax.loaded import Drafter, Target
from specjax.loop import bucket
from specjax.speculative import TreeSpec, cache_capacity
from specjax.train.prompts import with_long_share
from specjax.vocab.head import VocabHead, full_head


def with_lookup(grid: Sequence[TreeSpec], lookups: Sequence[int],
                lookup_mins: Sequence[int] = (1,)) -> tuple[TreeSpec, ...]:
    """``grid``, then each of its trees with a chain of each length in ``lookups`` grafted on
    a match of each length in ``lookup_mins``, so the calibration decides whether (and when)
    a chain pays for its verify rows."""
    return (*grid, *(dataclasses.replace(t, lookup=k, lookup_min=m)
                     for m in lookup_mins for k in lookups for t in grid if not t.lookup))


def step_estimate(curve: dict[str, Any], tree: TreeSpec, *, mal: float,
                  chained: float | None, draft_ms: float) -> dict[str, float]:
    """:func:`select_tree`'s estimate for one tree: ``{"verify_ms", "step_ms",
    "est_tokens_per_s", "est_speedup"}`` from its calibration ``mal``, the fraction of
    steps that grafted its lookup chain (``chained``; None without one), its draft time
    and the latency ``curve`` (``{"sizes", "fit_ms"}``, :func:`interp_latency`)."""
    verify_ms = interp_latency(curve, tree.num_nodes)
    if tree.lookup:
        # A lookup chain is verified only on the steps that grafted it (TreeSpec.lookup_min);
        # the others verify the tree without its rows.
        verify_ms = (chained * verify_ms + (1 - chained)
                     * interp_latency(curve, tree.num_nodes - tree.lookup))
    step_ms = verify_ms + draft_ms
    return {"verify_ms": verify_ms, "step_ms": step_ms, "est_tokens_per_s": 1e3 * mal / step_ms,
            "est_speedup": mal * interp_latency(curve, 1) / step_ms}


def select_tree(target: Target, drafter: Drafter, grid: Sequence[TreeSpec],
                calib_ids: Sequence[list[int]], curve: dict[str, Any], *, prompt_len: int,
                max_new_tokens: int, calib_max_new_tokens: int, stop_on_eos: bool, runs: int,
                head: VocabHead | None = None, bar: tqdm | None = None) -> dict[str, Any]:
    """Estimate each tree's decode speed and pick the fastest.

    speed = MAL / (verify_latency(T) + draft_time), with MAL from one batched greedy run
    over the calibration prompts (MAL is per row, so batching does not change it and
    costs one compile per tree), verify latency read off ``curve`` (for a tree with a
    lookup chain, averaged over the calibration steps with and without the chain) and draft time
    measured on the jitted draft phase, with the cache that generating ``max_new_tokens``
    from a ``prompt_len``-token prompt allocates for that tree. Vanilla decoding is
    estimated as 1 / latency(1). ``head`` is the drafter's vocabulary head (default full).
    """
    head = head or full_head(target.cfg.vocab_size)
    ctx = curve["context"]
    vanilla_ms = interp_latency(curve, 1)
    rows: list[dict[str, Any]] = []
    for tree in grid:
        if bar is not None:
            bar.set_description(f"calibrate {tree_label(tree)}")
        res = specjax.generate(target, [list(p) for p in calib_ids],
                               max_new_tokens=calib_max_new_tokens, stop_on_eos=stop_on_eos,
                               drafter=drafter, tree=tree, vocab=head)
        draft = draft_latency(target, drafter, tree, context=ctx,
                              capacity=cache_capacity(prompt_len, max_new_tokens, tree),
                              out_len=bucket(max_new_tokens), runs=runs, head=head)
        mal = res.stats["mean_accepted_length"]
        chained = res.stats["chained_fraction"] if tree.lookup else None
        rows.append({"label": tree_label(tree), "tree": tree_dict(tree), "mal": mal,
                     "calib_target_forwards": res.stats["target_forwards"],
                     "chained_fraction": chained, "draft_ms": draft["best_ms"],
                     "draft_median_ms": draft["median_ms"]}
                    | step_estimate(curve, tree, mal=mal, chained=chained,
                                    draft_ms=draft["best_ms"]))
        if bar is not None:
            bar.update()
    best = max(range(len(rows)), key=lambda i: rows[i]["est_tokens_per_s"])
    return {"grid": rows, "chosen_index": best, "chosen": rows[best],
            "vanilla_est_tokens_per_s": 1e3 / vanilla_ms,
            "formula": "est_tokens_per_s = MAL / (verify_latency(T = num_nodes) + draft_time); "
                       "est_speedup = that * latency(1); latencies from the monotone fit",
            "mal_note": MAL_NOTE}


# The paired run's prompts: Spec-Bench's mix of lengths (two of its six tasks give a
# 500-1,600-token text), as the A/Bs that chose the shipped trees drew them.
AB_LONG_SHARE = 1 / 3
AB_MAX_PROMPT_TOKENS = 1024


def ab_prompts(target: Target, num: int, *, questions: str | Path | None = None,
               given: Sequence[Sequence[int]] | None = None
               ) -> tuple[list[list[int]], dict[str, Any]]:
    """``num`` calibration prompts of Spec-Bench's mix of lengths, never Spec-Bench's own
    (the paired runs' prompts: :func:`specjax.bench.questions.calibration_prompts` with a
    third of long given texts); ``given`` in tests. Returns (ids, where they came from)."""
    return calibration_prompts(target, num=num, questions=questions, given=given,
                               weights=with_long_share(AB_LONG_SHARE),
                               max_prompt_tokens=AB_MAX_PROMPT_TOKENS)


def ab_prompt_records(target: Target, num: int, *, questions: str | Path | None = None,
                      given: Sequence[dict[str, Any]] | None = None
                      ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """:func:`ab_prompts` as the benchmarks' prompt records ``{"question_id": "c0", "task":
    its kind, "ids"}``, and where they came from (ShareGPT stats left out); ``given``: such
    records, in tests (their tasks kept)."""
    ids, info = ab_prompts(target, num, questions=questions,
                           given=None if given is None else [p["ids"] for p in given])
    kinds = info.get("kinds") or [p["task"] for p in given or []]
    return ([{"question_id": f"c{i}", "task": kind, "ids": x}
             for i, (x, kind) in enumerate(zip(ids, kinds, strict=True))],
            {k: v for k, v in info.items() if k != "stats"})


def tie_candidates(rows: Sequence[dict[str, Any]], k: int, within: float,
                   keep: Sequence[int] = ()) -> list[int]:
    """Indices of the ``k`` best estimated trees of a :func:`select_tree` grid whose estimate
    is within ``within`` (a fraction) of the best, best first; then those of ``keep`` (the
    stored default, trees given to compare, which run however they were estimated) not
    among them."""
    order = sorted(range(len(rows)), key=lambda i: -rows[i]["est_tokens_per_s"])
    top = rows[order[0]]["est_tokens_per_s"]
    cand = [i for i in order if rows[i]["est_tokens_per_s"] >= (1 - within) * top][:k]
    return [*cand, *(i for i in dict.fromkeys(keep) if i not in cand)]


def paired_ab(target: Target, drafter: Drafter, trees: Sequence[TreeSpec],
              labels: Sequence[str], prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
              stop_on_eos: bool, head: VocabHead | None = None, temperature: float = 0.0,
              top_p: float = 1.0, seed: int = 0) -> tuple[dict[str, Any], int]:
    """Run ``trees`` on ``prompts`` at batch 1, every prompt running every tree in turn with
    one seed (:func:`specjax.bench.paired.paired_runs`), and choose by
    :func:`specjax.bench.paired.choose`: the fastest, or at a speed tie the one whose MAL is
    higher by a resolved margin (MAL does not depend on the machine, greedy or sampled).

    Returns:
      (the A/B's record: the prompts' lengths; per tree its label, MAL, summed decode time,
      speed relative to the first tree (``vs_first``) and to the fastest with 95% intervals
      over prompts, MAL against the fastest's and per-prompt records; ``winner``,
      ``fastest``, ``tied`` and the rule that ``decided_by``; the chosen position in
      ``trees``).
    """
    runs = paired_runs(target, drafter, trees, prompts, max_new_tokens=max_new_tokens,
                       temperature=temperature, top_p=top_p, stop_on_eos=stop_on_eos,
                       seed=seed, vocab=head, desc="paired A/B")
    pick = choose(runs)
    results = [{"label": label, "mal": float(np.mean([r["mal"] for r in rows])),
                "decode_s": sum(r["spec_decode_s"] for r in rows),
                "vs_first": relative_speed(rows, runs[0]),
                "vs_fastest": pick["speed_vs_fastest"][j],
                "mal_vs_fastest": pick["mal_vs_fastest"][j], "per_prompt": rows}
               for j, (label, rows) in enumerate(zip(labels, runs, strict=True))]
    return {"prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts],
            "results": results, "winner": labels[pick["chosen"]],
            "fastest": labels[pick["fastest"]], "tied": [labels[j] for j in pick["tied"]],
            "decided_by": pick["decided_by"]}, pick["chosen"]


def tie_break(target: Target, drafter: Drafter, grid: Sequence[TreeSpec],
              selection: dict[str, Any], prompts: Sequence[Sequence[int]], *, k: int,
              within: float, max_new_tokens: int, stop_on_eos: bool,
              head: VocabHead | None = None, keep: Sequence[int] = ()) -> dict[str, Any]:
    """Break the estimate's near-ties end to end: the candidates of :func:`tie_candidates`,
    greedy, by :func:`paired_ab` (the first is the estimate's choice).

    ``keep`` (grid indices: the drafter's stored default, trees given to compare) run
    whatever their estimate, so the run says whether they win end to end.

    Returns:
      ``selection`` with ``"ab"`` (the candidates' labels, those that ran whatever their
      estimate, and :func:`paired_ab`'s record, each result with its grid ``index``) and,
      where another candidate won, ``chosen_index`` / ``chosen`` moved to it
      (``estimate_index`` keeps the estimate's).
    """
    rows = selection["grid"]
    cand = tie_candidates(rows, k, within, keep)
    ab: dict[str, Any] = {"k": k, "within": within,
                          "candidates": [rows[i]["label"] for i in cand],
                          "always_run": [rows[i]["label"] for i in keep]}
    out = {**selection, "estimate_index": selection["chosen_index"], "ab": ab}
    if len(cand) < 2:
        ab["skipped"] = (f"no other tree within {within:.0%} of the best estimate"
                         + (", which is the only tree to run always" if keep else ""))
        return out
    record, j = paired_ab(target, drafter, [grid[i] for i in cand], ab["candidates"], prompts,
                          max_new_tokens=max_new_tokens, stop_on_eos=stop_on_eos, head=head)
    for i, res in zip(cand, record["results"], strict=True):
        res["index"] = i
    ab |= record
    return out | {"chosen_index": cand[j], "chosen": rows[cand[j]]}
