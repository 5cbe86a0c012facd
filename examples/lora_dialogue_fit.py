"""Does online LoRA learn, from a conversation's earlier turns, to draft its next one?

Replays the first conversation of a ``specjax bench evospec --domains dialogue`` stream
(its turns rebuilt from the stored replies in ``<out>.partial.jsonl``) through an
:class:`~specjax.train.online_session.OnlineSession` per learning rate, and before the
session learns from turn k scores turn k: the first-draft agreement (argmax over the
stream's FR core, teacher-forced on the target's greedy reply) of the adapted drafter
against the frozen one. A diagnostic of the paper's setting at its most favourable (a
target that keeps repeating itself); a stream's MAL is the figure that decides.

    python examples/lora_dialogue_fit.py \\
        --partial results/bench_evospec_s34_dialogue.partial.jsonl --turns 13 \\
        --core 2048 --settings 1e-4:4,1e-3:8 --out results/lora_dialogue_fit.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

import specjax
from specjax.bench.common import write_json
from specjax.bench.dialogue import Histories, traces
from specjax.bench.evospec import DEFAULT_SKIP
from specjax.bench.phases import resolve_drafter
from specjax.bench.questions import resolve_questions
from specjax.defaults import resolve_model
from specjax.train.online import OnlineConfig
from specjax.train.online_session import OnlineSession, teacher_forced
from specjax.train.prompts import load_exclusions
from specjax.vocab import resolve_head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--partial", required=True, help="a dialogue stream's .partial.jsonl")
    ap.add_argument("--skip", type=int, default=DEFAULT_SKIP, help="the stream's --skip")
    ap.add_argument("--turns", type=int, default=13)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--core", type=int, default=2048)
    ap.add_argument("--settings", default="1e-4:4,1e-3:8",
                    help="learning rate:optax steps per update, comma-separated")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="results/lora_dialogue_fit.json")
    args = ap.parse_args()

    with open(args.partial) as f:
        records = [json.loads(line) for line in f]
    first = [r for r in records if r["record"] == records[0]["record"]][: args.turns]
    target = specjax.load(resolve_model(None))
    drafter, label = resolve_drafter(args.drafter, target)
    head = resolve_head(f"fr:{args.core}", target, drafter)
    turns = traces(target.tokenizer, len(first), skip=args.skip,
                   exclude=load_exclusions([resolve_questions(None)]))
    histories, seqs = Histories(target.tokenizer), []
    for turn, rec in zip(turns, first, strict=True):
        if (turn.record, turn.index) != (rec["record"], rec["turn"]):
            raise SystemExit(f"{args.partial} is not the stream from record {args.skip}: "
                             "pass its --skip")
        prompt = histories.prompt(turn)[0]
        reply = specjax.generate(target, [prompt],
                                 max_new_tokens=args.max_new_tokens).tokens[0]
        seqs.append((prompt, reply))
        histories.record(turn, target.tokenizer.decode(reply, skip_special_tokens=True))

    # The FR core is static, so every session drafts from the same active vocabulary.
    active = OnlineSession(target, drafter, head, adapt=False).active_vocabulary()

    def agreement(dr, prompt: list[int], reply: list[int]) -> float:
        """First-draft agreement of drafter ``dr`` on the reply's rows (teacher-forced)."""
        ids = prompt + reply
        nxt, rows = np.asarray(ids[1:]), np.arange(len(prompt) - 1, len(ids) - 1)
        pred = teacher_forced(target, dr.params, dr.cfg, ids, OnlineConfig.top_k, active)[3]
        return float(np.mean(pred[rows] == nxt[rows]))

    frozen = [agreement(drafter, p, r) for p, r in seqs]  # the same for every setting
    out = {"partial": args.partial, "drafter": label, "core": args.core,
           "record": first[0]["record"], "runs": {}}
    for setting in args.settings.split(","):
        lr, steps = setting.split(":")
        s = OnlineSession(target, drafter, head,
                          oc=OnlineConfig(lr=float(lr), steps_per_update=int(steps)))
        rows = []
        for k, (prompt, reply) in enumerate(tqdm(seqs, desc=setting)):
            rows.append({"turn": k, "updates_before": s.stats["updates"], "frozen": frozen[k],
                         "adapted": agreement(s.current_drafter(), prompt, reply)})
            # Serve turn k as the stream does (greedy: the same reply), then learn from it.
            s.generate([prompt], max_new_tokens=args.max_new_tokens)
        out["runs"][setting] = rows
        print(setting, [(r["frozen"], r["adapted"]) for r in rows])
    write_json(Path(args.out), out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
