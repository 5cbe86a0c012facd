"""Self-distillation data: the target's own answers (greedy, or sampled) to ShareGPT prompts.

At inference the drafter drafts continuations of the *target's* text, not of the
human/GPT text ShareGPT holds. Training it on the target's own generations (as
Medusa-2 and later EAGLE recipes do) puts the training contexts on the
distribution it is evaluated on. The records written here are pre-tokenised, so
``specjax train drafter --data FILE`` caches their hidden states like any other
data::

    {"tokens": prompt + answer ids, "assistant": 0 on the prompt, 1 on the answer,
     "prompt_index": i, "finished": the answer ended with EOS}

Two engines produce the same greedy answers (up to floating-point near-ties):
``specjax`` (``specjax.generate``) and ``transformers`` (``generate`` on the
checkpoint the target was converted from). On the 2-core development CPU,
transformers' batched generation was about twice as fast (B=32: 104 against 56
new tokens/s), so it is the default where torch is installed.

Sampled answers (``temperature > 0``) are the target's own distribution too: a second,
different answer per prompt for drafters that also draft at temperature 1, and more
contexts from the same prompts. Each batch draws from a key fixed by (seed, its first
prompt), so a resumed run samples what an uninterrupted one would.

Resumable: records are appended a batch at a time; a rerun with the same
settings (checked against ``FILE.meta.json``) skips the prompts already answered.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from specjax.checkpoint import write_json_atomic
from specjax.loaded import Target

ENGINES = ("transformers", "specjax")


def _meta_path(out: Path) -> Path:
    return out.with_name(out.name + ".meta.json")


def _complete(path: Path) -> tuple[list[str], list[dict], bool]:
    """(complete lines, their records, whether a torn last line was left out)."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    try:
        return lines, [json.loads(ln) for ln in lines], False
    except json.JSONDecodeError:
        # Only the last line can be torn: records are appended whole, a batch at a time.
        return lines[:-1], [json.loads(ln) for ln in lines[:-1]], True


def read_records(path: str | Path) -> list[dict]:
    """The complete records of a self-distill JSONL, read only: a torn last line (a crash,
    or a writer still appending) is left out and the file left as it is."""
    return _complete(Path(path))[1]


def _read_records(out: Path) -> list[dict]:
    """The records already in ``out``, before resuming it; a torn last line is cut off."""
    if not out.exists():
        return []
    lines, records, torn = _complete(out)
    if torn:
        out.write_text("".join(ln + "\n" for ln in lines))
    return records


class _TransformersEngine:
    """Batched greedy generation with transformers (left padding)."""

    def __init__(self, target: Target, hf_source: Path | None, threads: int | None):
        try:
            import torch
        except ModuleNotFoundError:
            raise ValueError("engine 'transformers' needs torch (pip install -e '.[test]'); "
                             "or use engine 'specjax' (--engine specjax)") from None

        from specjax.transformers_model import load_hf_model, resolve_hf_source

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.model = load_hf_model(resolve_hf_source(Path(target.path), hf_source), "float32")

    def __call__(self, prompts: Sequence[list[int]], max_new: int, eos: int,
                 temperature: float = 0.0, seed: int = 0) -> list[list[int]]:
        torch = self.torch
        width = max(map(len, prompts))
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        att = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            att[i, width - len(p):] = 1
        sample = {"do_sample": False}
        if temperature > 0:
            torch.manual_seed(seed)
            sample = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new,
                                      eos_token_id=eos, pad_token_id=eos, **sample)
        return [row.tolist() for row in out[:, width:]]


class _SpecjaxEngine:
    """Batched greedy generation with ``specjax.generate`` (vanilla decoding)."""

    def __init__(self, target: Target):
        self.target = target

    def __call__(self, prompts: Sequence[list[int]], max_new: int, eos: int,
                 temperature: float = 0.0, seed: int = 0) -> list[list[int]]:
        from specjax.api import generate

        return generate(self.target, [list(p) for p in prompts], max_new_tokens=max_new,
                        temperature=temperature, seed=seed).tokens


def _answer(tokens: list[int], eos_ids: Sequence[int]) -> tuple[list[int], bool]:
    """Cut a generated row after its first EOS (padding after it is dropped)."""
    for k, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[:k + 1], True
    return tokens, False


def generate_self_distill(target: Target, prompts: Sequence[list[int]], out: str | Path, *,
                          max_new_tokens: int = 256, batch_size: int = 32,
                          engine: str = "transformers", hf_source: Path | None = None,
                          threads: int | None = None, source: str = "",
                          kinds: Sequence[str] | None = None, temperature: float = 0.0,
                          seed: int = 0, progress: bool = True) -> dict:
    """Answer every prompt with the target (greedily by default) and append the records to
    ``out``.

    Args:
      prompts: chat-templated prompt ids, each ending with the assistant header.
      out: JSONL file (created or resumed); its settings go to ``out.meta.json``.
      engine: "transformers" (default; needs torch and the checkpoint the target
        was converted from) or "specjax".
      source: a description of where the prompts came from, stored in the meta.
      kinds: each prompt's kind (``specjax.train.prompts``), stored in its record.
      temperature: 0 answers greedily; > 0 samples from the target's full distribution
        at this temperature (no top-k/top-p), the batch at prompt i from key (seed, i).
    Returns:
      the meta dict: settings, records, answer tokens and how many hit EOS.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, not {engine!r}")
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError("max_new_tokens and batch_size must be >= 1")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, not {temperature}")
    out = Path(out)
    eos_ids = list(target.eos_ids)
    settings = {"format": "specjax-self-distill", "version": 1, "engine": engine,
                "max_new_tokens": max_new_tokens, "greedy": temperature == 0, "source": source,
                "target": Path(target.path).name, "num_prompts": len(prompts),
                "prompts_sha256": prompts_hash(prompts)}
    if temperature > 0:  # absent when greedy, so greedy files written before still resume
        settings |= {"temperature": temperature, "seed": seed}
    meta_path = _meta_path(out)
    records = _read_records(out)
    done = len(records)
    if done:
        if not meta_path.exists():
            raise FileExistsError(f"{out} exists without {meta_path.name}; choose another "
                                  "output file")
        old = json.loads(meta_path.read_text())
        if old["settings"] != settings:
            raise ValueError(f"{out} was generated with other settings ({old['settings']}); "
                             "choose another output file or delete it")
    out.parent.mkdir(parents=True, exist_ok=True)
    run: Any = (_TransformersEngine(target, hf_source, threads) if engine == "transformers"
                else _SpecjaxEngine(target))
    stats = {"records": done, "answer_tokens": sum(sum(r["assistant"]) for r in records),
             "finished": sum(bool(r["finished"]) for r in records)}
    bar = tqdm(total=len(prompts), initial=done, unit="prompt", desc="self-distill",
               disable=not progress, dynamic_ncols=True)
    for start in range(done, len(prompts), batch_size):
        batch = list(prompts[start:start + batch_size])
        rows = run(batch, max_new_tokens, eos_ids[0], temperature, seed * 1_000_003 + start)
        lines = []
        for k, (p, row) in enumerate(zip(batch, rows, strict=True)):
            ans, finished = _answer(row, eos_ids)
            rec = {"tokens": list(p) + ans, "assistant": [0] * len(p) + [1] * len(ans),
                   "prompt_index": start + k, "finished": finished}
            if kinds is not None:
                rec["kind"] = kinds[start + k]
            lines.append(json.dumps(rec))
            stats["answer_tokens"] += len(ans)
            stats["finished"] += int(finished)
        with open(out, "a") as f:
            f.write("\n".join(lines) + "\n")
        stats["records"] += len(batch)
        write_json_atomic(meta_path, {"settings": settings, **stats})
        bar.update(len(batch))
        bar.set_postfix(tokens=stats["answer_tokens"])
    bar.close()
    meta = {"settings": settings, **stats}
    write_json_atomic(meta_path, meta)
    return meta


def prompts_hash(prompts: Sequence[list[int]]) -> str:
    """The hex digest a self-distill file's meta records for its prompt list (order kept)."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(np.asarray(p, np.int64).tobytes() + b"|")
    return h.hexdigest()


def sharegpt_prompts(tokenizer: Any, *, num: int, skip: int, max_prompt_tokens: int,
                     source: str | Path = "sharegpt") -> list[list[int]]:
    """The first ``num`` usable first user turns after ``skip`` records (chat-templated)."""
    from specjax.train.router_data import first_user_prompts

    return list(itertools.islice(first_user_prompts(source, tokenizer, skip=skip,
                                                    max_prompt_tokens=max_prompt_tokens), num))
