"""Choose the draft tree for sampling the way ``bench spec`` chooses the greedy one.

Sequoia's rule: the fastest tree maximises calibration MAL over the time a step takes. At a
temperature above 0 a drafted child is accepted with probability ``min(1, p / q)``, not
when it is the target's argmax, so the tree that wins differs from the greedy one (a
second sampled child, for instance, is accepted where the first was rejected, by
multi-draft rejection sampling). For each candidate (``--tree-json``, repeated; the first
is the reference), on calibration prompts (ShareGPT's calibration range, never
Spec-Bench):

1. **MAL**: tokens over target forwards at ``--temperature``, pooled over the prompts and
   ``--seeds`` seeds, ``--batch`` prompts a call (MAL does not depend on the machine), with
   a 95% interval on the difference from the first tree that resamples (prompt, seed)
   pairs, paired;
2. **step time**: milliseconds a target forward, from ``--timing-prompts`` prompts at batch
   1, vanilla and every tree in turn on each, ``--timing-reps`` passes (the first, which
   compiles, is dropped), so the machine's drift between runs falls on all of them alike.

Prompt length matters to both: a tree's extra draft level and verify rows cost more over a
long context (tree attention reads the whole cache), and a long given text changes what is
accepted. So ``--long-share`` of the calibration prompts (a third by default, as two of
Spec-Bench's six tasks, summarization and RAG, give 500-1,600 tokens of text) give a long
text to summarize or answer from (``summarize_long`` / ``passage_qa_long``: 450-1,000
tokens, :mod:`specjax.train.prompts`), and the timed prompts are spread over the
calibration set's lengths (:func:`length_stratified`), not only its short ones.

The estimate is MAL x (vanilla ms a token) / (ms a step), its two factors from different
runs (batched MAL, batch-1 steps on a few prompts), so two candidates within a few percent
of each other are not told apart by it: confirm such a pair end to end with
``sampled_speedup.py --calibration 48 --long-share 0.333 --max-prompt-tokens 1024`` (a
paired A/B, then again with ``--skip`` on a disjoint set; in the sixty-first session an
estimated +3.7% read 0.999 [0.979, 1.020] that way). The highest estimate wins, and
``--save-default-tree`` stores it as the drafter's tree for sampling (``default_tree.json``'s
``sampled``; :func:`specjax.tree.default.write_sampled_default_tree`), which
``specjax.generate`` drafts at temperature > 0 when given no tree. The MAL part resumes
from ``--out`` (each finished call is saved there).

``--temperature 0`` calibrates the greedy default the same way (one seed: a greedy run does
not depend on it), and ``--save-default-tree`` then stores the winner as the greedy tree,
keeping the file's head and its tree for sampling. ``specjax bench spec`` chooses from its
grid of chains and EAGLE-2 trees with a latency model instead; this measures given
candidates' steps directly, so it can weigh trees the grid lacks (a root with two
children, say, whose extra verify row costs almost nothing on the row-dot kernel).

    python examples/sampled_tree_calibration.py --out results/sampled_tree_calibration.json \\
        --tree-json '{"kind": "chain", "depth": 1, "lookup": 8, "lookup_min": 2}' \\
        --tree-json '{"kind": "dyspec-threshold", "depth": 1, "total_tokens": 2,
                      "threshold": 0.001, "lookup": 8, "lookup_min": 2}'
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from tqdm import tqdm

import specjax
from specjax.bench.common import machine_info, write_json
from specjax.bench.questions import calibration_prompts
from specjax.defaults import resolve_model, shipped_drafter_for
from specjax.train.prompts import with_long_share
from specjax.tree import TreeSpec
from specjax.tree.default import (
    read_default_vocab,
    write_default_tree,
    write_sampled_default_tree,
)


def _key(tree: TreeSpec) -> str:
    return json.dumps(tree.to_json(), sort_keys=True)


def length_stratified(prompts: list[list[int]], n: int) -> list[list[int]]:
    """``n`` of ``prompts`` at evenly spaced ranks of their lengths (the shortest and the
    longest among them when n >= 2), so the timed steps see the calibration set's mix of
    context lengths; in order of length."""
    ranked = sorted(prompts, key=len)
    if n >= len(ranked):
        return ranked
    picks = np.linspace(0, len(ranked) - 1, n) if n > 1 else [len(ranked) // 2]
    return [ranked[int(round(i))] for i in picks]


def sampled_mal(target, drafter, trees: list[TreeSpec], prompts: list[list[int]], *,
                temperature: float, seeds: int, batch: int, max_new_tokens: int,
                done: dict[str, list], save) -> dict[str, np.ndarray]:
    """Per tree, [prompts * seeds, 2] (tokens, target forwards) of each (prompt, seed).
    ``done`` holds finished calls by key (resumed); ``save`` is called after each new one."""
    calls = [(t, s, lo) for t in trees for s in range(seeds)
             for lo in range(0, len(prompts), batch)]
    for tree, seed, lo in tqdm(calls, desc=f"MAL at T={temperature}"):
        key = f"{_key(tree)}|{seed}|{lo}"
        if key in done:
            continue
        res = specjax.generate(target, prompts[lo:lo + batch], drafter=drafter, tree=tree,
                               seed=seed, max_new_tokens=max_new_tokens,
                               temperature=temperature)
        done[key] = [[sum(row), len(row)] for row in res.stats["accept_lengths"]]
        save()
    return {_key(t): np.array([r for s in range(seeds) for lo in range(0, len(prompts), batch)
                               for r in done[f"{_key(t)}|{s}|{lo}"]], np.float64)
            for t in trees}


def mal_difference_ci(x: np.ndarray, base: np.ndarray, draws: int = 10_000,
                      seed: int = 0) -> list[float]:
    """95% interval of pooled MAL(x) - pooled MAL(base), both [U, 2] (tokens, forwards) over
    the same (prompt, seed) units, resampling units, paired."""
    pick = np.random.default_rng(seed).integers(0, len(x), (draws, len(x)))
    boot = (x[pick, 0].sum(1) / x[pick, 1].sum(1)
            - base[pick, 0].sum(1) / base[pick, 1].sum(1))
    return [float(v) for v in np.percentile(boot, [2.5, 97.5])]


def step_times(target, drafter, trees: list[TreeSpec], prompts: list[list[int]], *,
               temperature: float, reps: int, max_new_tokens: int) -> dict[str, float]:
    """Milliseconds a target forward: vanilla's (key "vanilla") and each tree's, every
    configuration in turn on each prompt, the first of ``reps`` passes dropped."""
    spent = {k: [0.0, 0.0] for k in ["vanilla", *map(_key, trees)]}
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, stop_on_eos=False)
    runs = [(r, i, t) for r in range(reps) for i in range(len(prompts))
            for t in [None, *trees]]
    for rep, i, tree in tqdm(runs, desc="step time"):
        res = (specjax.generate(target, [prompts[i]], seed=i, **kw) if tree is None else
               specjax.generate(target, [prompts[i]], drafter=drafter, tree=tree, seed=i,
                                **kw))
        if rep == 0:
            continue
        st = res.stats
        n = st["new_tokens"] - 1  # the first new token is the prefill's
        acc = spent["vanilla" if tree is None else _key(tree)]
        acc[0] += n / st["decode_tokens_per_s"]
        acc[1] += n if tree is None else st["target_forwards"]
    return {k: 1e3 * s / max(n, 1) for k, (s, n) in spent.items()}


def save_choice(folder: Path, tree: TreeSpec, measured: dict, *, temperature: float) -> Path:
    """Store ``tree`` in ``folder``'s default_tree.json: as the greedy tree at temperature 0
    (the file's head kept: every candidate drafted with it), else as the tree for sampling
    at ``temperature`` (the greedy tree, head and other temperatures' trees kept). Returns
    the file's path."""
    if temperature == 0:
        return write_default_tree(folder, tree, measured,
                                  vocab=read_default_vocab(folder) or "full")
    return write_sampled_default_tree(folder, tree, measured, temperature=temperature)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree-json", action="append", required=True, metavar="JSON",
                    help="a candidate TreeSpec as JSON; repeat it (the first is the reference)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--calibration", type=int, default=48, metavar="N",
                    help="about N calibration prompts for MAL (default 48)")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--long-share", type=float, default=1 / 3, metavar="F",
                    help="share of calibration prompts that give a long text (450-1,000 "
                         "tokens) to summarize or answer from (default 1/3)")
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--timing-prompts", type=int, default=9,
                    help="prompts timed at batch 1, spread over the calibration set's "
                         "lengths (default 9)")
    ap.add_argument("--timing-reps", type=int, default=2,
                    help="passes over the timing prompts, the first (compiling) dropped; >= 2")
    ap.add_argument("--save-default-tree", action="store_true",
                    help="store the winner as the shipped drafter's tree for sampling (at "
                         "--temperature 0: as its greedy tree)")
    ap.add_argument("--out", type=Path, default=Path("results/sampled_tree_calibration.json"))
    args = ap.parse_args()
    if args.temperature < 0:
        ap.error("--temperature must be >= 0 (0: greedy)")
    if args.timing_prompts < 1 or args.timing_reps < 2:
        # The first pass compiles and is dropped: one pass would time nothing, and the
        # estimates would be 0 ms a step and nan x vanilla.
        ap.error(f"--timing-prompts must be >= 1 and --timing-reps >= 2 (the first pass, "
                 f"which compiles, is dropped), got {args.timing_prompts} and "
                 f"{args.timing_reps}")
    if not 0 <= args.long_share <= 1:
        ap.error(f"--long-share must be in [0, 1], got {args.long_share}")
    greedy = args.temperature == 0
    if greedy:
        args.seeds = 1  # greedy runs are the same for every seed
    try:
        trees = [TreeSpec.from_json_text(t) for t in args.tree_json]
    except ValueError as e:
        ap.error(str(e))
    target = specjax.load(resolve_model(None, progress=False))
    folder = shipped_drafter_for(target.cfg)
    drafter = specjax.load_drafter(folder, target)
    prompts, source = calibration_prompts(target, num=args.calibration,
                                          weights=with_long_share(args.long_share),
                                          max_prompt_tokens=args.max_prompt_tokens)
    prev = json.loads(args.out.read_text()) if args.out.is_file() else {}
    settings = {"temperature": args.temperature, "prompts": len(prompts), "seeds": args.seeds,
                "batch": args.batch, "max_new_tokens": args.max_new_tokens,
                "long_share": args.long_share, "max_prompt_tokens": args.max_prompt_tokens}
    done = prev.get("calls", {}) if prev.get("settings") == settings else {}
    result = {"settings": settings, "source": source, "calls": done}
    mal = sampled_mal(target, drafter, trees, prompts, temperature=args.temperature,
                      seeds=args.seeds, batch=args.batch, max_new_tokens=args.max_new_tokens,
                      done=done, save=lambda: write_json(args.out, result))
    timed = length_stratified(prompts, args.timing_prompts)
    ms = step_times(target, drafter, trees, timed, temperature=args.temperature,
                    reps=args.timing_reps, max_new_tokens=args.max_new_tokens)
    base = mal[_key(trees[0])]
    rows = []
    for tree in trees:
        x = mal[_key(tree)]
        m = x[:, 0].sum() / x[:, 1].sum()
        ci = mal_difference_ci(x, base)
        rows.append({"tree": tree.to_json(), "mal": m, "mal_vs_first_ci95": ci,
                     "ms_per_step": ms[_key(tree)],
                     "est_speedup": m * ms["vanilla"] / ms[_key(tree)]})
        print(f"{_key(tree)}\n  MAL {m:.3f} (vs the first "
              f"[{ci[0]:+.3f}, {ci[1]:+.3f}])  {ms[_key(tree)]:.1f} ms a step  "
              f"est. {rows[-1]['est_speedup']:.3f}x vanilla ({ms['vanilla']:.1f} ms a token)")
    best = max(rows, key=lambda r: r["est_speedup"])
    result |= {"candidates": rows, "vanilla_ms_per_token": ms["vanilla"], "chosen": best,
               "timing_prompts": len(timed), "timing_prompt_tokens": list(map(len, timed)),
               "timing_reps": args.timing_reps,
               "machine": machine_info()}
    write_json(args.out, result)
    print(f"chosen: {_key(TreeSpec.from_json(best['tree']))}")
    if args.save_default_tree:
        how = ("examples/sampled_tree_calibration.py: calibration MAL at the temperature / "
               "ms a step at batch 1, highest wins")
        measured = {"how": how, "chosen": best, "candidates": rows, "settings": settings,
                    "vanilla_ms_per_token": ms["vanilla"], "results": str(args.out),
                    "machine": result["machine"]}
        where = save_choice(folder, TreeSpec.from_json(best["tree"]), measured,
                            temperature=args.temperature)
        print(f"saved as the {'greedy tree' if greedy else 'tree for sampling'} in {where}")


if __name__ == "__main__":
    main()
