"""What did a stream's online LoRA do to the drafter's first draft, and where?

``specjax bench evospec`` saves each configuration's session after every request
(``<out>.state/lora``). This restores the adapter a stream ended with and compares the
merged drafter with the frozen one, teacher-forced on the target's greedy answers to the
last ``--last`` prompts of each of the stream's domains (prompts the adapter saw, so an
adapter that fits its samples should gain here if anywhere): first-draft agreement (argmax
over the stream's FR core), the rows it lost and gained, and of the lost rows how many
have an argmax outside the target's top-K (``--top-k``, the support eq. 5 scores).

    python examples/lora_diagnose.py --state results/bench_evospec.state/lora \\
        --core 2048 --out results/lora_diagnose.json

The stream's settings (drafter, domains, requests per domain, core) must be the run's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

import specjax
from specjax.api import encode_prompts
from specjax.bench.evospec import DEFAULT_SKIP, domain_prompts
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
    ap.add_argument("--state", required=True, help="a stream's saved session (…state/lora)")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--domains", default="code,translate")
    ap.add_argument("--per-domain", type=int, default=40)
    ap.add_argument("--last", type=int, default=8)
    ap.add_argument("--skip", type=int, default=DEFAULT_SKIP)
    ap.add_argument("--core", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=OnlineConfig.top_k)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="results/lora_diagnose.json")
    args = ap.parse_args()

    target = specjax.load(resolve_model(None))
    drafter, label = resolve_drafter(args.drafter, target)
    # The stream's `lora` configuration: the static FR core, the adapter restored into it.
    sess = OnlineSession(target, drafter, resolve_head(f"fr:{args.core}", target, drafter))
    sess.restore(args.state)
    active, adapted = sess.active_vocabulary(), sess.current_drafter()
    exclude = load_exclusions([resolve_questions(None)])
    out = {"state": args.state, "drafter": label, "core": args.core, "top_k": args.top_k,
           "updates": sess.stats["updates"], "domains": {}}
    for domain in args.domains.split(","):
        prompts = domain_prompts(target.tokenizer, domain, args.per_domain, skip=args.skip,
                                 exclude=exclude, max_tokens=256)[-args.last:]
        c = dict.fromkeys(("rows", "frozen", "adapted", "lost", "lost_outside_top_k",
                           "gained"), 0)
        for prompt in tqdm(prompts, desc=domain):
            ids0 = encode_prompts(target, prompt, True, None)[0]
            ids = ids0 + specjax.generate(target, [ids0],
                                          max_new_tokens=args.max_new_tokens).tokens[0]
            rows = np.arange(len(ids0) - 1, len(ids) - 1)  # row t drafts ids[t + 1]
            nxt = np.asarray(ids)[rows + 1]
            keep = active[nxt]  # a token outside the core is the vocabulary's miss
            pred = {}
            for name, dr in (("frozen", drafter), ("adapted", adapted)):
                _, top_ids, _, first = teacher_forced(target, dr.params, dr.cfg, ids,
                                                      args.top_k, active)
                pred[name] = first[rows]
            top = top_ids[rows]
            hit = {k: keep & (v == nxt) for k, v in pred.items()}
            lost = hit["frozen"] & ~hit["adapted"]
            c["rows"] += int(keep.sum())
            c["frozen"] += int(hit["frozen"].sum())
            c["adapted"] += int(hit["adapted"].sum())
            c["lost"] += int(lost.sum())
            c["gained"] += int((hit["adapted"] & ~hit["frozen"]).sum())
            c["lost_outside_top_k"] += int(sum(pred["adapted"][i] not in top[i]
                                               for i in np.flatnonzero(lost)))
        c["agreement"] = {k: c[k] / max(c["rows"], 1) for k in ("frozen", "adapted")}
        out["domains"][domain] = c
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
