"""``specjax bench vocab``: the drafter's vocabulary heads compared on one Spec-Bench subset.

For each head (full, FR-Spec at several sizes, PA-FR, DynaSpec fixed top-k and
position-aware), on the same prompts as ``specjax bench spec`` (greedy, batch 1, chat
template where the target has one, the same draft tree for every head: EAGLE-2's by
default, the drafter's measured one with ``--tree default``, or any tree ``--tree-json``
names):

* mean accepted length per task and overall (the bonus token counted);
* mean shortlist size (valid candidates per expanded node) and coverage (the fraction of
  steps whose first committed token was in the root expansion's shortlist);
* the draft step's latency (the jitted draft phase, greedy draws, B=1) against the full head's;
* decode tokens/s against vanilla decoding in the same run, and heads against each other
  on the same prompts (speed and MAL; each head against the first one listed, the full
  head by default, or against the heads ``--versus`` names, ``all`` for every pair), with
  95% intervals that resample prompts, paired, so that a difference between heads reads as
  resolved or not;
* greedy equality with vanilla decoding for every prompt (it must hold for every head:
  verification is always over the full vocabulary).

``--temperature T`` (> 0) compares the heads sampled, as FR-Spec's Table 3 and EvoSpec's
Appendix H do (EvoSpec normalises speed to FR-Spec's at the same temperature: ``--versus
fr:8192``): vanilla and every head draw with one seed a prompt (``--seed`` + its index)
and decode the whole budget (no EOS stop), so a prompt's times cover as many tokens and
its methods are paired; ``--tree default`` is then the drafter's tree for sampling. No
equality is counted (the output's distribution is the target's: the chi-square tests).

``--calibration N`` runs the same comparison on N calibration prompts instead (ShareGPT,
Spec-Bench's mix of lengths, never its questions: the prompts ``bench spec``'s paired
A/Bs use), so that a head or a router can be chosen without reading the evaluation; the
per-task columns are then the prompt kinds (chat, summarize, passage QA, translate).

EvoSpec's head (``evospec:8192+256``) is stateful: each prompt starts from an empty
buffer, which then evolves within the request.

DynaSpec's router reads only the drafter fc's input, so XLA may overlap it with the
drafter layer; :func:`router_overlap` times the layer, the router and both in one jitted
call and reports whether the sum is saved.

Per-prompt results go to ``<out stem>.partial.jsonl``; a rerun skips those done.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import specjax
from specjax.bench.common import (
    as_command,
    check_sampling,
    first_mismatch,
    machine_info,
    paired_speedup,
    pyplot,
    save_figure,
    write_json,
)
from specjax.bench.paired import mal_difference
from specjax.bench.partial import append_record, partial_path, read_partial
from specjax.bench.phases import draft_latency, random_features, resolve_drafter
from specjax.bench.questions import (
    TASKS,
    load_questions,
    question_ids,
    resolve_questions,
    select_questions,
    uses_chat,
)
from specjax.bench.spec_report import SAMPLING_NOTE
from specjax.bench.spec_select import ab_prompt_records
from specjax.bench.timing import count_compiles, ensure_warm, warmup_tokens
from specjax.bench.trees import add_tree_args, resolve_tree, tree_dict, tree_from_args
from specjax.defaults import resolve_model
from specjax.drafter import drafter_hidden, in_target_layout, init_drafter_cache
from specjax.loaded import Drafter, Target
from specjax.loop import bucket
from specjax.speculative import TreeSpec, cache_capacity
from specjax.vocab import VocabHead, resolve_head
from specjax.vocab.dynaspec import RoutedHead
from specjax.vocab.router import router_logits

# fr:2730 is FR-Spec at the stage-1 router's mean DynaSpec-PA shortlist on EAGLE-2 (the
# same budget).
DEFAULT_HEADS = ("full", "fr:2730", "fr:8192", "fr:16384", "fr:32768", "pafr:32768",
                 "dynaspec-f", "dynaspec", "dynaspec-shared", "evospec:8192+256")


def _generate(target: Target, drafter: Drafter | None, head: VocabHead | None, tree: TreeSpec,
              ids: list[int], max_new_tokens: int, temperature: float = 0.0,
              seed: int = 0) -> dict[str, Any]:
    # Sampled runs decode the whole budget: EOS drawn at different steps would leave the
    # methods' times over different token counts.
    kw: dict[str, Any] = {"temperature": temperature, "seed": seed,
                          "stop_on_eos": temperature == 0}
    if drafter is not None:
        kw |= {"drafter": drafter, "tree": tree, "vocab": head}
    with count_compiles() as n:
        res = specjax.generate(target, [ids], max_new_tokens=max_new_tokens, **kw)
    s = res.stats
    rec = {"tokens": res.tokens[0], "new_tokens": s["new_tokens"], "decode_s": s["decode_s"],
           "compiles_while_timed": n[0]}
    if drafter is not None:
        rec |= {k: s[k] for k in ("mean_accepted_length", "mean_shortlist_size",
                                  "shortlist_coverage", "target_forwards")}
        rec["accepted_tokens"] = int(sum(s["accept_lengths"][0]))
    return rec


def router_overlap(target: Target, drafter: Drafter, head: RoutedHead, *, k: int,
                   context: int, runs: int) -> dict[str, float]:
    """Does XLA overlap the router with the drafter layer? Best-of ms of each and of both.

    One expansion of ``k`` nodes at ``context`` committed rows. ``saved_ms`` is
    layer + router - both: about the router's time if they overlap, about 0 if not.
    Sub-millisecond figures on a shared machine are noisy, so ``overlapped`` also asks
    the saving to exceed the spread of the best three ``both`` calls.
    """
    cfg, dtype = target.cfg, target.params.embed.dtype
    cache = init_drafter_cache(drafter.cfg, 1, context + 64, dtype)
    cache = dataclasses.replace(cache, lengths=jnp.full((1,), context, jnp.int32))
    tokens = jnp.arange(1, k + 1, dtype=jnp.int32)[None]
    feats = random_features((1, k, cfg.hidden_size), dtype)
    pos = context + jnp.zeros((1, k), jnp.int32)
    mask = jnp.eye(k, dtype=bool)[None]

    dparams = in_target_layout(drafter.params, target.params)  # as generate runs it

    # Weights and cache are arguments, not closed-over constants: XLA would otherwise fold
    # the embedding gather of the fixed tokens at compile time and time less than a step does.
    def layer(feats, dparams, embed, cache):
        return drafter_hidden(dparams, drafter.cfg, embed, tokens, feats, pos, cache,
                              block_mask=mask, write_rows=pos + jnp.arange(k))[0]

    def router(feats, router_params, embed):
        ctx = jnp.concatenate([embed[tokens].astype(feats.dtype), feats], -1)
        return router_logits(router_params, ctx)

    embed = target.params.embed
    calls = {"layer": (jax.jit(layer), (feats, dparams, embed, cache)),
             "router": (jax.jit(router), (feats, head.router, embed)),
             "both": (jax.jit(lambda f, dp, r, e, c: (layer(f, dp, e, c), router(f, r, e))),
                      (feats, dparams, head.router, embed, cache))}
    times = {}
    for name, (fn, args) in calls.items():
        jax.block_until_ready(fn(*args))
        times[name] = sorted(_timed(fn, *args) for _ in range(runs))
    out = {name: t[0] for name, t in times.items()}
    out["saved_ms"] = out["layer"] + out["router"] - out["both"]
    out["noise_ms"] = times["both"][2] - times["both"][0]
    out["overlapped"] = bool(out["saved_ms"] > max(0.5 * out["router"], out["noise_ms"]))
    out["k"] = k
    return out


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return 1e3 * (time.perf_counter() - t0)


def run_vocab_bench(model_dir: str | Path, drafter_dir: str | Path | None, *,
                    heads: Sequence[str] = DEFAULT_HEADS, per_task: int = 4,
                    tasks: Sequence[str] = TASKS, max_new_tokens: int = 128,
                    tree: TreeSpec | str | None = None, runs: int = 5,
                    questions: str | Path | None = None, versus: Sequence[str] | None = None,
                    temperature: float = 0.0, seed: int = 0, calibration: int = 0,
                    out: str | Path = "results/bench_vocab.json",
                    calibration_given: Sequence[Sequence[int]] | None = None
                    ) -> dict[str, Any]:
    """Run the comparison; writes ``out`` (JSON), a PNG beside it, and returns the result.

    ``tree``: every head's draft tree (default: :class:`TreeSpec`'s EAGLE-2 tree;
    ``"default"``: the drafter's measured greedy tree, see :func:`resolve_tree`).
    ``versus``: the heads every other head is paired against (the result's ``"paired"``,
    see :func:`pairs`; default: the first head). ``temperature`` > 0: sampled, one seed a
    prompt (``seed`` + its index) shared by vanilla and every head, no EOS stop, no
    equality counted; ``"default"`` is then the drafter's tree for sampling.
    ``calibration`` > 0: that many calibration prompts instead of Spec-Bench's (``tasks``
    and ``per_task`` unused; the prompts' kinds are the tasks); ``calibration_given``: their
    ids, in tests.
    """
    check_sampling(temperature)
    if calibration < 0:  # before the models load
        raise ValueError(f"calibration takes a number of prompts >= 0, got {calibration}")
    greedy = temperature == 0
    out = Path(out)
    compared = pairs(heads, versus)  # before the run: a bad name costs no decoding
    target = specjax.load(model_dir)
    drafter, drafter_label = resolve_drafter(drafter_dir, target)
    tree = resolve_tree(tree, drafter, temperature=temperature)
    built = {spec: resolve_head(spec, target, drafter) for spec in heads}
    prompts, calib = _prompts(target, questions, tasks, per_task, calibration,
                              calibration_given)
    if calib is not None:
        tasks = list(dict.fromkeys(task for _, task, _ in prompts))
    config = {"heads": list(heads), "tasks": list(tasks), "per_task": per_task,
              "max_new_tokens": max_new_tokens, "tree": tree_dict(tree),
              "drafter": drafter_label, "chat_template": uses_chat(target)}
    if calib is not None:  # Spec-Bench runs keep their partial files' key
        config |= {"calibration": calib}
    if not greedy:  # greedy runs keep their partial files' key
        config |= {"temperature": temperature, "seed": seed}
    config = json.loads(json.dumps(config))  # as the partial file holds it (tuples -> lists)
    part = partial_path(out)
    done = {r["question_id"]: r for r in read_partial(part) if r.get("config") == config}
    warm: set[tuple[str, int]] = set()
    bar = tqdm(total=len(prompts) * (len(heads) + 1), desc="bench vocab")
    records = []
    for i, (qid, task, ids) in enumerate(prompts):
        if qid in done:
            records.append(done[qid])
            bar.update(len(heads) + 1)
            continue
        rec: dict[str, Any] = {"config": config, "question_id": qid, "task": task}
        for spec in ("vanilla", *heads):
            dr, head = (None, None) if spec == "vanilla" else (drafter, built[spec])
            ensure_warm(warm, (spec, bucket(len(ids))), partial(  # an untimed compile
                _generate, target, dr, head, tree, ids, warmup_tokens(max_new_tokens),
                temperature))
            bar.set_description(f"q{qid} {spec}")
            rec[spec] = _generate(target, dr, head, tree, ids, max_new_tokens, temperature,
                                  seed + i)
            if spec != "vanilla" and greedy:
                rec[spec]["mismatch_at"] = first_mismatch(rec[spec]["tokens"],
                                                          rec["vanilla"]["tokens"])
                if rec[spec]["mismatch_at"] is not None:
                    tqdm.write(f"!! {spec} differs from vanilla on question {qid} at "
                               f"token {rec[spec]['mismatch_at']}")
            bar.update()
        append_record(part, rec)
        records.append(rec)
    bar.close()

    ctx = int(np.mean([len(r["vanilla"]["tokens"]) for r in records])) + 128
    capacity = cache_capacity(ctx, max_new_tokens, tree)
    latency = {}
    for spec in tqdm(heads, desc="draft-step latency"):
        latency[spec] = draft_latency(target, drafter, tree, context=ctx, capacity=capacity,
                                      out_len=bucket(max_new_tokens), runs=runs,
                                      head=built[spec])
    routed = [h for h in built.values() if isinstance(h, RoutedHead)]
    # The rows one drafter call expands: the root's one, and EAGLE-2's beam below it.
    ks = (1, tree.top_k) if tree.kind == "eagle2" else (1,)
    overlap = [router_overlap(target, drafter, routed[0], k=k, context=ctx, runs=50)
               for k in ks] if routed else []
    result = {"config": config, "machine": machine_info(),
              "sampling": None if greedy else {"temperature": temperature, "seed": seed,
                                               "note": SAMPLING_NOTE},
              "heads": {spec: summarize(records, spec, latency[spec], latency["full"]
                                        if "full" in latency else None, tasks)
                        for spec in heads},
              "vanilla": _rates(records, "vanilla"), "router_overlap": overlap,
              "head_capacity": {spec: [built[spec].capacity(t) for t in range(tree.max_depth)]
                                for spec in heads},
              "vocab_size": target.cfg.vocab_size, "prompts": len(records)}
    for h in result["heads"].values():
        h["speedup_vs_vanilla"] = h["decode_tokens_per_s"] / result["vanilla"][
            "decode_tokens_per_s"]
    result["paired"] = [{"head": h, "base": b, **against(records, h, b)} for h, b in compared]
    write_json(out, result)
    plot_vocab(result, out.with_suffix(".png"))
    print(summary(result))
    return result


def _prompts(target: Target, questions: str | Path | None, tasks: Sequence[str],
             per_task: int, calibration: int, given: Sequence[Sequence[int]] | None
             ) -> tuple[list[tuple[Any, str, list[int]]], dict[str, Any] | None]:
    """(question id, task, token ids) of every prompt, and where calibration prompts came
    from (None for Spec-Bench's): ``calibration`` > 0 takes the paired A/Bs' calibration
    prompts (:func:`specjax.bench.spec_select.ab_prompts`), ids "c0", "c1", ... and their
    kinds as tasks."""
    if calibration:
        recs, info = ab_prompt_records(target, calibration, questions=questions, given=None
                                       if given is None else [{"task": "given", "ids": p}
                                                              for p in given])
        return [(r["question_id"], r["task"], r["ids"]) for r in recs], info
    qs = select_questions(load_questions(resolve_questions(questions)), tasks, per_task)
    return [(q.question_id, q.task, question_ids(target, q.text)) for q in qs], None


def pairs(heads: Sequence[str], versus: Sequence[str] | None) -> list[tuple[str, str]]:
    """The (head, base) pairs to compare: each head against each base in ``versus`` (default
    the first head; ``["all"]``: every pair, the base the one listed first), a pair once."""
    versus = list(heads[:1] if versus is None else heads if list(versus) == ["all"] else versus)
    unknown = [b for b in versus if b not in heads]
    if unknown:
        raise ValueError(f"--versus names {unknown}, which --heads does not run ({list(heads)}); "
                         "name bases among the heads, or 'all' for every pair")
    out: list[tuple[str, str]] = []
    for b in versus:
        for h in heads:
            if h != b and (h, b) not in out and (b, h) not in out:
                out.append((h, b))
    return out


def against(records: Sequence[dict], spec: str, base: str) -> dict[str, Any]:
    """Head ``spec`` against head ``base`` on the same prompts: ``speed`` (base's decode time
    over spec's, :func:`paired_speedup`) and ``mal`` (the mean over prompts of spec's MAL
    minus base's), each with a 95% interval resampling prompts, paired."""
    def mal(name: str) -> list[dict[str, float]]:
        return [{"mal": r[name]["mean_accepted_length"]} for r in records]

    return {"speed": paired_speedup([r[base] for r in records], [r[spec] for r in records]),
            "mal": mal_difference(mal(spec), mal(base))}


def _rates(records: Sequence[dict], spec: str) -> dict[str, float]:
    toks = sum(r[spec]["new_tokens"] - 1 for r in records)
    return {"decode_tokens_per_s": toks / sum(r[spec]["decode_s"] for r in records)}


def _mal(rs: Sequence[dict]) -> float:
    return sum(r["accepted_tokens"] for r in rs) / sum(r["target_forwards"] for r in rs)


def summarize(records: Sequence[dict], spec: str, latency: dict, full_latency: dict | None,
              tasks: Sequence[str]) -> dict[str, Any]:
    """Pooled figures of one head over the prompts (MAL = committed / target forwards)."""
    rs = [r[spec] for r in records]
    forwards = np.array([r["target_forwards"] for r in rs], float)
    vs_vanilla = paired_speedup([r["vanilla"] for r in records], rs)
    return {
        "mal": _mal(rs),
        "mal_per_task": {t: _mal([r[spec] for r in records if r["task"] == t]) for t in tasks},
        "mean_shortlist_size": float(np.average([r["mean_shortlist_size"] for r in rs],
                                                weights=forwards)),
        "shortlist_coverage": float(np.average([r["shortlist_coverage"] for r in rs],
                                               weights=forwards)),
        "draft_ms": latency["best_ms"],
        "draft_speedup_vs_full": (full_latency["best_ms"] / latency["best_ms"]
                                  if full_latency else None),
        "greedy_matches": (sum(r["mismatch_at"] is None for r in rs)
                           if all("mismatch_at" in r for r in rs) else None),
        "prompts": len(rs),
        "speedup_ci95": None if vs_vanilla is None else vs_vanilla["ci95"],
        **_rates(records, spec),
    }


def plot_vocab(r: dict[str, Any], path: Path) -> Path:
    """MAL per task per head (left); draft-step time vs mean shortlist size (middle); where
    heads were paired, each pair's speed ratio with its 95% interval (right: an interval
    clear of 1 is a resolved difference), its MAL difference in the label."""
    plt = pyplot()

    heads, tasks = list(r["heads"]), r["config"]["tasks"]
    paired = [v for v in r.get("paired", []) if v["speed"] is not None]
    fig, axes = plt.subplots(1, 3 if paired else 2, figsize=(21 if paired else 14, 4.8))
    ax, bx = axes[:2]
    width = 0.8 / len(heads)
    for i, h in enumerate(heads):
        vals = [r["heads"][h]["mal_per_task"][t] for t in tasks] + [r["heads"][h]["mal"]]
        ax.bar(np.arange(len(tasks) + 1) + i * width, vals, width, label=h)
    ax.set_xticks(np.arange(len(tasks) + 1) + 0.4 - width / 2, [*tasks, "overall"],
                  rotation=20)
    ax.set_ylabel("mean accepted length")
    top = max(max(s["mal_per_task"].values()) for s in r["heads"].values())
    # MAL >= 1: start there so heads differ (and keep a span where every head accepted 1).
    ax.set_ylim(1.0, 1.0 + 1.25 * max(top - 1.0, 0.1))
    ax.legend(fontsize=7, ncol=5, loc="upper center")
    for h in heads:
        x, y = r["heads"][h]["mean_shortlist_size"], r["heads"][h]["draft_ms"]
        bx.scatter(x, y)
        bx.annotate(h, (x, y), fontsize=8)
    bx.set_xlabel("mean shortlist size (tokens)")
    bx.set_ylabel("draft step (ms, B=1)")
    if paired:
        cx, y = axes[2], np.arange(len(paired))[::-1]
        ratio = np.array([v["speed"]["ratio"] for v in paired])
        ci = np.array([v["speed"]["ci95"] for v in paired])
        cx.errorbar(ratio, y, xerr=[ratio - ci[:, 0], ci[:, 1] - ratio], fmt="o", capsize=3)
        cx.axvline(1.0, color="gray", lw=0.8, ls="--")
        cx.set_yticks(y, [f"{v['head']} vs {v['base']}\nMAL {v['mal']['diff']:+.3f}"
                          for v in paired], fontsize=7)
        cx.set_xlabel("speed ratio, same prompts (95% interval)")
        cx.set_title("heads paired", fontsize=10)
    return save_figure(fig, path, dpi=120)


def summary(r: dict[str, Any]) -> str:
    """A markdown table of the run."""
    lines = ["| head | MAL | % of full MAL | mean shortlist | coverage | draft ms | "
             "draft speedup | tok/s | vs vanilla | greedy equal |", "|" + "---|" * 10]
    full = r["heads"].get("full", {}).get("mal")
    for h, s in r["heads"].items():
        pct = f"{100 * s['mal'] / full:.1f}" if full else "-"
        sp = f"{s['draft_speedup_vs_full']:.2f}×" if s["draft_speedup_vs_full"] else "-"
        ci = s.get("speedup_ci95")
        vs = f"{s['speedup_vs_vanilla']:.2f}×" + ("" if ci is None else
                                                  f" [{ci[0]:.2f}, {ci[1]:.2f}]")
        equal = "-" if s["greedy_matches"] is None else f"{s['greedy_matches']}/{s['prompts']}"
        lines.append(f"| {h} | {s['mal']:.2f} | {pct} | {s['mean_shortlist_size']:.0f} | "
                     f"{s['shortlist_coverage']:.3f} | {s['draft_ms']:.1f} | {sp} | "
                     f"{s['decode_tokens_per_s']:.1f} | {vs} | {equal} |")
    if r.get("paired"):
        lines += ["", "| head | against, same prompts | speed [95%] | MAL difference [95%] |",
                  "|---|---|---|---|"]
        for v in r["paired"]:
            speed = ("-" if v["speed"] is None else f"{v['speed']['ratio']:.3f} "
                     f"[{v['speed']['ci95'][0]:.3f}, {v['speed']['ci95'][1]:.3f}]")
            m = v["mal"]
            lines.append(f"| {v['head']} | {v['base']} | {speed} | {m['diff']:+.3f} "
                         f"[{m['ci95'][0]:+.3f}, {m['ci95'][1]:+.3f}] |")
    tasks = r["config"]["tasks"]
    lines += ["", "| head | " + " | ".join(tasks) + " | overall |",
              "|" + "---|" * (len(tasks) + 2)]
    for h, s in r["heads"].items():
        lines.append(f"| {h} | " + " | ".join(f"{s['mal_per_task'][t]:.2f}" for t in tasks)
                     + f" | {s['mal']:.2f} |")
    lines.append(f"\nvanilla: {r['vanilla']['decode_tokens_per_s']:.1f} tok/s")
    if calib := r["config"].get("calibration"):
        lines.append(f"prompts: {r['prompts']} calibration prompts (ShareGPT from record "
                     f"{calib.get('skip')}, not Spec-Bench); columns are their kinds")
    if r.get("sampling"):
        lines.append(f"temperature {r['sampling']['temperature']:g}, seeds "
                     f"{r['sampling']['seed']}+, no EOS stop. {r['sampling']['note']}")
    for o in r["router_overlap"]:
        lines.append(f"router overlap, K={o['k']}: layer {o['layer']:.2f} ms, router "
                     f"{o['router']:.2f} ms, both in one jit {o['both']:.2f} ms "
                     f"({'overlapped' if o['overlapped'] else 'not overlapped'})")
    return "\n".join(lines)


def add_vocab_args(p: argparse.ArgumentParser) -> None:
    """Attach ``specjax bench vocab``'s flags to a (sub)parser."""
    p.add_argument("--model", default=None, help="converted target (default: SmolLM2)")
    p.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one)")
    p.add_argument("--heads", default=",".join(DEFAULT_HEADS),
                   help="comma-separated --vocab specs to compare")
    p.add_argument("--versus", default=None,
                   help="comma-separated heads to pair every other head against, speed and "
                        "MAL on the same prompts (default: the first head; 'all': every pair)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 (default): greedy, each head checked against vanilla token for "
                        "token; > 0: sampled, one seed a prompt shared by vanilla and every "
                        "head, no EOS stop (--tree default: the drafter's tree for sampling)")
    p.add_argument("--seed", type=int, default=0,
                   help="with --temperature > 0: the first prompt's seed (default 0)")
    p.add_argument("--per-task", type=int, default=4)
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--calibration", type=int, default=0, metavar="N",
                   help="compare on N calibration prompts (ShareGPT, Spec-Bench's mix of "
                        "lengths, never its questions: choose a head or router here) instead "
                        "of the Spec-Bench prompts; --tasks/--per-task then unused")
    p.add_argument("--max-new-tokens", type=int, default=128)
    add_tree_args(p, auto=False, drafter_default=True)
    p.add_argument("--runs", type=int, default=5, help="timed calls per latency (best kept)")
    p.add_argument("--questions", default=None, help="Spec-Bench question.jsonl")
    p.add_argument("--out", default="results/bench_vocab.json")


def run_vocab_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Run :func:`run_vocab_bench` from :func:`add_vocab_args`'s flags."""
    t0 = time.perf_counter()
    r = run_vocab_bench(
        resolve_model(args.model), args.drafter, heads=args.heads.split(","),
        per_task=args.per_task, tasks=args.tasks.split(","), max_new_tokens=args.max_new_tokens,
        tree=tree_from_args(args),
        runs=args.runs, questions=args.questions,
        versus=None if args.versus is None else args.versus.split(","),
        temperature=args.temperature, seed=args.seed, calibration=args.calibration,
        out=args.out)
    print(f"bench vocab: {time.perf_counter() - t0:.0f} s")
    return r


def add_parser(bench: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``vocab`` to ``specjax bench``'s subparsers; ``args.run`` runs it."""
    p = bench.add_parser(
        "vocab", help="vocabulary heads (full, FR, PA-FR, DynaSpec): MAL, shortlist, speed")
    add_vocab_args(p)
    p.set_defaults(run=as_command(run_vocab_from_args))
    return p
