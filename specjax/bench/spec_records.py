"""One ``bench spec`` prompt's records, and the figures pooled over a group of them.

:class:`PromptRunner` decodes one prompt by one method (vanilla, speculative compiled or
eager), compiling each (method, prompt bucket) in an untimed call first;
:func:`run_turn` runs the methods on one turn of an evaluation prompt and checks greedy
output against vanilla's; :func:`aggregate` pools a task's (or a run's) records into its
MAL, rates and speedups (:mod:`specjax.bench.spec` runs them, and reports what they give).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

import specjax
from specjax.bench.common import first_mismatch, generation_record, paired_speedup
from specjax.bench.questions import follow_up_ids
from specjax.bench.timing import count_compiles, ensure_warm, warmup_tokens
from specjax.loaded import Drafter, Target
from specjax.loop import bucket
from specjax.speculative import TreeSpec
from specjax.vocab.head import VocabHead


class PromptRunner:
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


def turn_count(p: dict[str, Any]) -> int:
    """How many turns of evaluation prompt ``p`` a run asks: one, or with ``--turns all``
    every turn of the question (``"turns"``; tests: 1 + ``len(p["later_ids"])``)."""
    if "turns" in p:
        return len(p["turns"])
    return 1 + len(p.get("later_ids", []))


def follow_up(target: Target, p: dict[str, Any], ids: list[int],
               answers: Sequence[list[int]]) -> list[int]:
    """Prompt ids of turn ``len(answers) + 1`` of ``p``, its earlier turns answered by
    ``answers``: through the chat template (:func:`follow_up_ids`), or in tests the
    previous turn's ids, its answer and the next turn's given ids, as they are."""
    if "turns" in p:
        return follow_up_ids(target, p["turns"], answers)
    return [*ids, *answers[-1], *p["later_ids"][len(answers) - 1]]


def run_turn(runner: PromptRunner, p: dict[str, Any], ids: list[int], turn: int, *, seed: int,
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
