"""``specjax bench mips``: EvoSpec's semantic recall, HNSW against the exact top-k.

Queries are what EvoSpec queries with: the target's final hidden state at each position of
its own greedy answers (the first prompt of each Spec-Bench task). For each, the exact
top-10 LM-head rows by inner product (= the target's top-10 logits) against faiss's HNSW
(M = 32) over norm-augmented rows at several ``efSearch``: recall@10 and milliseconds per
query (batch 1, on the host, as the paper runs it), plus the index's build time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np


def run_mips_bench(model: str | None, *, max_new_tokens: int = 64, k: int = 10,
                   out: str | Path = "results/bench_mips.json") -> dict[str, Any]:
    """HNSW against the exact top-``k`` over the LM head (recall@k and latency,
    :func:`specjax.vocab.mips.compare`), queried with the target's final hidden states of
    its own greedy answers to one Spec-Bench prompt per task (``max_new_tokens`` each); the
    result is written to ``out`` and returned."""
    import jax.numpy as jnp

    import specjax
    from specjax.bench.common import machine_info, write_json
    from specjax.bench.questions import TASKS, spec_bench_prompts
    from specjax.defaults import resolve_model
    from specjax.model import forward_hidden, init_cache
    from specjax.vocab.mips import compare

    target = specjax.load(resolve_model(model))
    evals, qpath = spec_bench_prompts(target, questions=None, tasks=TASKS, per_task=1)
    queries = []
    for e in evals:
        ans = specjax.generate(target, [e["ids"]], max_new_tokens=max_new_tokens).tokens[0]
        ids = e["ids"] + ans
        n = len(ids)
        hidden, _, _ = forward_hidden(target.params, target.cfg, jnp.asarray([ids]),
                                      jnp.arange(n)[None], init_cache(target.cfg, 1, n))
        queries.append(np.asarray(hidden[0, len(e["ids"]) - 1:n - 1], np.float32))
    w = np.asarray(target.params.head, np.float32)
    result = {"questions": str(qpath), "machine": machine_info(),
              **compare(w, np.concatenate(queries), k=k)}
    write_json(Path(out), result)
    return result


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("mips", help="EvoSpec's recall: HNSW vs exact top-k",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", default="results/bench_mips.json")
    p.set_defaults(run=lambda a: print(json.dumps(
        run_mips_bench(a.model, max_new_tokens=a.max_new_tokens, out=a.out), indent=1)) or 0)
    return p
