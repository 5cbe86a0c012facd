"""Greedy outputs on Spec-Bench prompts, dumped to JSON and compared across code versions.

A refactor of the loop must not change a single token. Run this once on the old checkout
and once on the new one, then compare::

    PYTHONPATH=/path/to/old python examples/greedy_identity.py dump before.json
    python examples/greedy_identity.py dump after.json
    python examples/greedy_identity.py compare before.json after.json

``dump`` generates, for the first ``--per-task`` questions of each Spec-Bench task, the
greedy continuation of the default model (vanilla, and speculative with the shipped drafter
under several trees and vocabulary heads); every speculative run must equal vanilla.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import specjax
from specjax.bench.common import write_json
from specjax.bench.questions import TASKS, load_questions, select_questions
from specjax.defaults import default_drafter_dir, ensure_default_target


def spec_bench_prompts(path: Path, per_task: int) -> list[str]:
    """First-turn prompts, the first ``per_task`` of each task, tasks in sorted order."""
    return [q.text for q in select_questions(load_questions(path), sorted(TASKS), per_task)]


def dump(out: Path, questions: Path, per_task: int, max_new_tokens: int) -> int:
    prompts = spec_bench_prompts(questions, per_task)
    target = specjax.load(ensure_default_target())
    drafter = specjax.load_drafter(default_drafter_dir(), target)
    configs = {
        "vanilla": {},
        "eagle2-full": dict(drafter=drafter),
        "chain3-fr8192": dict(drafter=drafter, tree=specjax.TreeSpec("chain", depth=3),
                              vocab="fr:8192"),
        "eagle2-dynaspec": dict(drafter=drafter, vocab="dynaspec"),
    }
    tokens = {}
    for name, kw in configs.items():
        res = specjax.generate(target, prompts, max_new_tokens=max_new_tokens, **kw)
        tokens[name] = res.tokens
        print(f"{name}: MAL {res.stats.get('mean_accepted_length')}", flush=True)
    bad = [n for n in tokens if tokens[n] != tokens["vanilla"]]
    write_json(out, {"prompts": prompts, "by_config": tokens})
    print(f"wrote {out}" + (f"; NOT equal to vanilla: {bad}" if bad else ""))
    return 1 if bad else 0


def compare(a: Path, b: Path) -> int:
    x, y = json.loads(a.read_text()), json.loads(b.read_text())
    if x["prompts"] != y["prompts"]:
        print("the dumps are of different prompts")
        return 1
    status = 0
    for name in x["by_config"]:
        same = x["by_config"][name] == y["by_config"].get(name)
        n = sum(map(len, x["by_config"][name]))
        print(f"{name}: {'identical' if same else 'DIFFERENT'} ({n} tokens)")
        status |= not same
    return status


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out", type=Path)
    d.add_argument("--questions", type=Path,
                   default=Path(__file__).resolve().parents[2] / "shared" / "data"
                   / "spec_bench" / "question.jsonl")
    d.add_argument("--per-task", type=int, default=4)
    d.add_argument("--max-new-tokens", type=int, default=48)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = p.parse_args()
    if args.cmd == "dump":
        return dump(args.out, args.questions, args.per_task, args.max_new_tokens)
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
