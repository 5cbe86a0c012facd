"""Paired end-to-end runs: several draft trees on the same prompts, each prompt running every
tree in turn, so the machine's drift between runs (often larger than the differences between
trees) falls on all of them alike.

An estimate from a latency model (``bench spec``'s calibration MAL over measured step
costs) cannot tell trees apart within about a percent; a paired run can, to the extent its
interval says: the speed of one tree relative to another is the ratio of their summed
decode times over the same prompts, with a 95% interval that resamples whole prompts
(:func:`relative_speed`). ``bench spec --ab-trees`` breaks its estimate's near-ties this
way, and ``examples/sampled_speedup.py`` compares trees when sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

import specjax
from specjax.bench.common import ratio_of_sums
from specjax.loaded import Drafter, Target
from specjax.speculative import TreeSpec


def run_order(n_trees: int, prompt: int) -> list[int]:
    """The order the trees run in on prompt number ``prompt``: rotated by one each prompt, so
    each runs first (right after vanilla) equally often, and a cost of running first, if
    there is one, falls on every tree alike. (Fifty-fourth session: with a fixed order the
    first of two trees read 1.5% slower, 1.015 [0.976, 1.056]; rotated, the same two trees
    read 0.995 [0.965, 1.027]: neither resolved.)"""
    return [(prompt + j) % n_trees for j in range(n_trees)]


def relative_speed(rows: Sequence[dict], base: Sequence[dict]) -> dict[str, Any]:
    """Speed of one tree relative to ``base`` (both run on the same prompts and seeds):
    base's summed decode time over this tree's, with a 95% interval that resamples whole
    prompts, paired (a run's speed varies by tens of percent from prompt to prompt, for
    every tree alike).

    Args:
      rows, base: one record per prompt, in the same order, each with ``tokens`` and
        ``spec_decode_s`` (:func:`paired_runs`' records).
    Returns:
      ``{"ratio": float, "ci95": [lo, hi]}``; above 1 means this tree ran faster.
    Raises:
      ValueError: the rows are not of the same prompts and lengths.
    """
    if [r["tokens"] for r in rows] != [r["tokens"] for r in base]:
        raise ValueError("the trees must have run the same prompts to the same lengths")
    ratio, ci = ratio_of_sums(np.array([r["spec_decode_s"] for r in base]),
                              np.array([r["spec_decode_s"] for r in rows]))
    return {"ratio": ratio, "ci95": ci}


def paired_runs(target: Target, drafter: Drafter, trees: Sequence[TreeSpec | None],
                prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128,
                temperature: float = 0.0, top_p: float = 1.0, stop_on_eos: bool = False,
                seed: int = 0, vocab: Any = None, vanilla: bool = False,
                tasks: Sequence[str] | None = None,
                desc: str = "paired") -> list[list[dict[str, Any]]]:
    """Run every tree on every prompt at batch 1, the trees' order rotated from prompt to
    prompt (:func:`run_order`), with one seed per prompt shared by every tree.

    Decode time leaves compiles out (``decode_tokens_per_s``), so no warm-up is needed; a
    prompt's first new token comes from the prefill and is not counted.

    Args:
      trees: the candidates (None: the drafter's own tree at ``temperature``).
      prompts: [P] prompts as token ids.
      top_p: nucleus filtering of every draw at ``temperature`` > 0 (1 = off).
      vocab: the drafter's head (None: the drafter's default).
      vanilla: also run vanilla decoding on each prompt first (its time goes into every
        tree's record as ``vanilla_decode_s``, over the tree's token count: both run
        ``max_new_tokens`` when ``stop_on_eos`` is off, the same tokens when greedy).
      tasks: [P] labels stored in the records (default "calibration").
    Returns:
      [len(trees)][P] records ``{"task", "prompt_tokens", "tokens", "spec_decode_s", "mal",
      "chained_fraction"}`` (+ ``"vanilla_decode_s"``).
    """
    rows: list[list[dict[str, Any]]] = [[] for _ in trees]
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
              stop_on_eos=stop_on_eos)
    for i, ids in enumerate(tqdm(prompts, desc=desc, leave=False)):
        ids = list(ids)
        van = specjax.generate(target, [ids], seed=seed + i, **kw) if vanilla else None
        for j in run_order(len(trees), i):
            spec = specjax.generate(target, [ids], drafter=drafter, tree=trees[j],
                                    vocab=vocab, seed=seed + i, **kw)
            n = spec.stats["new_tokens"] - 1
            rec = {"task": tasks[i] if tasks is not None else "calibration",
                   "prompt_tokens": len(ids), "tokens": n,
                   "spec_decode_s": n / spec.stats["decode_tokens_per_s"] if n else 0.0,
                   "mal": spec.stats["mean_accepted_length"],
                   "chained_fraction": spec.stats["chained_fraction"]}
            if van is not None:
                rec["vanilla_decode_s"] = n / van.stats["decode_tokens_per_s"] if n else 0.0
            rows[j].append(rec)
    return rows


def mal_difference(rows: Sequence[dict], base: Sequence[dict]) -> dict[str, Any]:
    """Mean over prompts of one tree's MAL minus ``base``'s on the same prompts, with a 95%
    interval that resamples whole prompts, paired."""
    if len(rows) != len(base):
        raise ValueError("the trees must have run the same prompts")
    d = np.array([r["mal"] - b["mal"] for r, b in zip(rows, base, strict=True)])
    diff, ci = ratio_of_sums(d, np.ones_like(d))
    return {"diff": diff, "ci95": ci}


def choose(runs: Sequence[Sequence[dict]]) -> dict[str, Any]:
    """The choice among trees run on the same prompts (:func:`paired_runs`' output): the
    fastest by summed decode time; but where another tree's speed interval against it holds
    1 (a tie on this machine) and that tree's MAL is higher by a resolved margin, that tree
    (the highest such MAL). MAL does not depend on the machine, so at a speed tie here it
    is the better bet elsewhere: the rule the shipped trees were chosen by since the
    fifty-eighth session.

    Returns:
      ``{"chosen", "fastest"}`` (indices into ``runs``), ``"tied"`` (the indices whose
      speed ties the fastest's, itself included), ``"speed_vs_fastest"`` and
      ``"mal_vs_fastest"`` (one :func:`relative_speed` / :func:`mal_difference` each), and
      ``"decided_by"``: ``"speed"``, ``"speed tie: the fastest"`` (no tied tree's MAL is
      higher by a resolved margin) or ``"speed tie: the higher MAL"``.
    """
    if not runs:
        raise ValueError("no trees to choose from")
    time = [sum(r["spec_decode_s"] for r in rows) for rows in runs]
    fast = int(np.argmin(time))
    speed = [relative_speed(rows, runs[fast]) for rows in runs]
    mal = [mal_difference(rows, runs[fast]) for rows in runs]
    tied = [i for i in range(len(runs)) if i == fast or speed[i]["ci95"][1] >= 1]
    better = [i for i in tied if mal[i]["ci95"][0] > 0]
    chosen = max(better, key=lambda i: mal[i]["diff"]) if better else fast
    decided = ("speed" if len(tied) == 1 else
               "speed tie: the higher MAL" if better else "speed tie: the fastest")
    return {"chosen": chosen, "fastest": fast, "tied": tied, "speed_vs_fastest": speed,
            "mal_vs_fastest": mal, "decided_by": decided}
