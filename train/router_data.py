"""Router training data: run the full-vocabulary drafter on ShareGPT and record each expansion.

DynaSpec (appendix A.2) trains its router on what an EAGLE-2 run with the full head drafts:
for every expanded node, the router's input [embedding(x_t); the drafter's input feature]
and the full head's top-L tokens at that draft step. We run the real speculative loop
(greedy, full head, the engine's draft tree) on the first user turn of ShareGPT
conversations, with ``SpecConfig.record_top_l`` set so the draft phase returns those records,
and append them to shards (:func:`specjax.train.router.write_router_shard`).

Resumable: ``progress.json`` holds the conversations done and the shards written; a rerun
skips both. Records are stored as float16 contexts and int32 token ids.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from specjax.checkpoint import write_json_atomic
from specjax.loaded import Drafter, Target
from specjax.runner import Request, all_done
from specjax.sampling import SamplingConfig
from specjax.speculative import (
    SpecConfig,
    TreeSpec,
    draft_phase_jit,
    spec_prefill,
    verify_phase_jit,
)
from specjax.train.data import normalize_messages, training_records
from specjax.train.prompts import encode_user_turn
from specjax.train.router import write_router_meta, write_router_shard
from specjax.vocab.head import full_head
from specjax.vocab.router import fingerprint


def first_user_prompts(source: str | Path, tokenizer: Any, *, skip: int,
                       max_prompt_tokens: int) -> Iterator[list[int]]:
    """First user turns of a ShareGPT-style file, after ``skip`` records: chat-templated,
    or as plain text (BOS first) for a base model's tokenizer, which has no template.

    Training data: read through :func:`specjax.train.data.training_records`, so ShareGPT's
    records from ``CALIBRATION_START`` on (the prompts `bench spec` calibrates on) never are.
    """
    for i, rec in enumerate(training_records(source)):
        if i < skip:
            continue
        msgs = normalize_messages(rec)
        if not msgs or msgs[0]["role"] != "user":
            continue
        ids = encode_user_turn(tokenizer, msgs[0]["content"])
        if len(ids) <= max_prompt_tokens:
            yield list(ids)


def collect_router_data(target: Target, drafter: Drafter, out_dir: str | Path, *,
                        source: str | Path | Iterable[list[int]] = "sharegpt",
                        num_records: int = 40_000,
                        top_l: int = 8, tree: TreeSpec | None = None, skip: int = 2000,
                        max_prompt_tokens: int = 384, max_new_tokens: int = 96,
                        shard_records: int = 4096, progress: bool = True) -> dict:
    """Record ``num_records`` drafter expansions into ``out_dir``; returns the meta dict.

    Each record: x [2d] float16 (the router context), topl [L] int32 (the full head's
    top-L candidates, best first), step int32 (the draft step t). Prompts are the first
    user turns of conversations after the first ``skip`` (the drafter's training data) of
    ``source`` ("sharegpt" or a ShareGPT-style file), or ``source`` itself when it is an
    iterable of token-id lists.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tree = tree or TreeSpec()
    d = target.cfg.hidden_size
    meta = {"in_dim": 2 * d, "top_l": top_l, "vocab_size": target.cfg.vocab_size,
            "drafter_fingerprint": fingerprint(drafter.params), "tree": dataclasses.asdict(tree),
            "source": str(source) if isinstance(source, str | Path) else "token ids",
            "skip": skip, "max_new_tokens": max_new_tokens}
    prog_path = out / "progress.json"
    prog = {"conversations": 0, "shards": 0, "records": 0}
    if prog_path.exists():
        prog = json.loads(prog_path.read_text())
        if prog.get("meta", {}).get("drafter_fingerprint") != meta["drafter_fingerprint"]:
            raise ValueError(f"{out} holds router data from another drafter; use a new folder")
    sampling = SamplingConfig(temperature=0.0)
    spec = SpecConfig(cfg=target.cfg, drafter=drafter.cfg, tree=tree,
                      sampling=sampling.static(), record_top_l=top_l)
    head = full_head(target.cfg.vocab_size)
    buf: dict[str, list[np.ndarray]] = {"x": [], "topl": [], "step": []}
    bar = tqdm(total=num_records, initial=prog["records"], desc="router data", unit="rec",
               disable=not progress)
    prompts = (first_user_prompts(source, target.tokenizer, skip=skip,
                                  max_prompt_tokens=max_prompt_tokens)
               if isinstance(source, str | Path) else iter(source))
    for _ in range(prog["conversations"]):
        next(prompts, None)
    while prog["records"] < num_records:
        ids = next(prompts, None)
        if ids is None:
            break
        req = Request.build(target, [ids], max_new_tokens=max_new_tokens, sampling=sampling,
                            stop_on_eos=True, key=jax.random.PRNGKey(0), tree=tree)
        state = spec_prefill(target.params, drafter.params, req.prompt, req.prompt_lens,
                             req.limits, req.key, spec=spec, out_len=req.out_len,
                             capacity=req.capacity)
        got = 0
        while not all_done(state):
            draft, state = draft_phase_jit(target.params, drafter.params, head, state, spec=spec)
            for ctx, top, step in draft.shortlists.records:
                n = ctx.shape[0] * ctx.shape[1]
                buf["x"].append(np.asarray(ctx, np.float16).reshape(n, -1))
                buf["topl"].append(np.asarray(top, np.int32).reshape(n, -1))
                buf["step"].append(np.full((n,), int(step), np.int32))
                got += n
            # The verify program never reads the records: drop them rather than pass them.
            draft = dataclasses.replace(draft, shortlists=dataclasses.replace(
                draft.shortlists, records=None))
            state = verify_phase_jit(target.params, drafter.params, head, state, draft,
                                    spec=spec)
        prog["conversations"] += 1
        prog["records"] += got
        bar.update(got)
        if sum(map(len, buf["step"])) >= shard_records or prog["records"] >= num_records:
            write_router_shard(out, prog["shards"], *(np.concatenate(buf[k])
                                                      for k in ("x", "topl", "step")))
            prog["shards"] += 1
            buf = {k: [] for k in buf}
            prog["meta"] = meta
            write_json_atomic(prog_path, prog)
    bar.close()
    if buf["step"]:  # the corpus ran out before num_records
        write_router_shard(out, prog["shards"], *(np.concatenate(buf[k])
                                                  for k in ("x", "topl", "step")))
        prog["shards"] += 1
    prog["meta"] = meta
    write_json_atomic(prog_path, prog)
    extra = {k: v for k, v in meta.items() if k not in ("in_dim", "top_l", "vocab_size",
                                                        "drafter_fingerprint")}
    write_router_meta(out, in_dim=meta["in_dim"], top_l=top_l, vocab_size=meta["vocab_size"],
                      drafter_fingerprint=meta["drafter_fingerprint"],
                      num_records=prog["records"], extra=extra)
    return meta | {"num_records": prog["records"]}
