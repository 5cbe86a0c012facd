"""Prompts the target writes itself: Magpie's pre-query template (Xu et al., 2024).

An instruction-tuned target given its chat template up to the start of a user turn's text
(system turn included) samples a plausible user request and closes the turn with its end
token. The requests come from the distribution the target was tuned on (SmolLM2's SmolTalk
holds Magpie-Ultra), they never run out, and none is a ShareGPT conversation, so they add
prompt diversity where ShareGPT's first user turns before the calibration records are used
up. The target's answers to them are drafter training data like any other
(``examples/gpu_drafter/prepare.py --self-prompts``).

The raw file is a self-distill JSONL (:func:`generate_self_distill`, resumable) whose prompt
is the pre-query ids and whose "answer" is the sampled user turn; :func:`read_user_turns`
keeps the finished ones, once each, none sharing an 8-word shingle with the evaluation.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specjax.train.prompts import encode_user_turn, shares_shingle
from specjax.train.selfdistill import generate_self_distill, read_records

_SENTINEL = "\x00user-turn\x00"
_SPACE = re.compile(r"\s+")


def pre_query(tokenizer: Any) -> list[int]:
    """The chat template's ids before a user turn's text: [P] ids, ending where the user's
    words begin (for SmolLM2, the default system turn and ``<|im_start|>user\\n``).

    Raises ValueError for a tokenizer without a chat template (a base model has no user
    turn to continue).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("self-written prompts need a chat template; this tokenizer has none "
                         "(a base model)")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}],
                                         add_generation_prompt=False, tokenize=False)
    if text.count(_SENTINEL) != 1:
        raise ValueError("the chat template does not render a user turn's text verbatim; "
                         "its pre-query prefix cannot be found")
    return list(tokenizer.encode(text.split(_SENTINEL)[0], add_special_tokens=False))


def write_user_turns(target: Any, num: int, out: str | Path, *, max_new_tokens: int = 128,
                     batch_size: int = 64, engine: str = "transformers", seed: int = 0,
                     threads: int | None = None, progress: bool = True) -> dict:
    """Sample ``num`` user turns from the target at temperature 1 (full distribution) and
    append them to ``out`` (created or resumed; its settings in ``out.meta.json``).

    Returns the self-distill meta: settings, records, tokens and how many closed their turn
    (``finished``); a turn cut at ``max_new_tokens`` is dropped by :func:`read_user_turns`.
    """
    if num < 1:
        raise ValueError(f"num must be >= 1, not {num}")
    pre = pre_query(target.tokenizer)
    return generate_self_distill(
        target, [pre] * num, out, max_new_tokens=max_new_tokens, batch_size=batch_size,
        engine=engine, threads=threads, temperature=1.0, seed=seed, progress=progress,
        source="self-written user turns (Magpie pre-query template)")


def read_user_turns(paths: str | Path | Sequence[str | Path], tokenizer: Any, *,
                    exclude: set[tuple[str, ...]] | None = None,
                    min_words: int = 4) -> tuple[list[str], dict]:
    """The user turns of one or more :func:`write_user_turns` files worth asking the target.

    Kept: turns that closed (hit an end id), of at least ``min_words`` words, the first of
    each text across the files (case and whitespace folded), sharing no 8-word shingle with
    ``exclude`` (the evaluation's and the held-out prompts' shingles). A torn last line
    is skipped.

    Returns:
      (texts in file order, counts: records, unfinished, short, duplicate, excluded, kept).
    """
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    pre = pre_query(tokenizer)
    stats = dict.fromkeys(("records", "unfinished", "short", "duplicate", "excluded", "kept"), 0)
    seen: set[str] = set()
    texts = []
    for path in map(Path, paths):
        for rec in read_records(path):  # read only: the writer may still be appending
            stats["records"] += 1
            if rec["tokens"][:len(pre)] != pre:
                raise ValueError(f"{path}: a record does not start with this tokenizer's "
                                 "pre-query ids: written for another target")
            if not rec["finished"]:
                stats["unfinished"] += 1
                continue
            text = tokenizer.decode(rec["tokens"][len(pre):-1],
                                    skip_special_tokens=True).strip()
            key = _SPACE.sub(" ", text).casefold()
            if len(key.split()) < min_words:
                stats["short"] += 1
            elif key in seen:
                stats["duplicate"] += 1
            elif exclude and shares_shingle(text, exclude):
                stats["excluded"] += 1
            else:
                seen.add(key)
                texts.append(text)
    stats["kept"] = len(texts)
    return texts, stats


def self_prompt_ids(paths: str | Path | Sequence[str | Path], tokenizer: Any, *,
                    exclude: set[tuple[str, ...]] | None = None,
                    max_prompt_tokens: int = 320) -> tuple[list[list[int]], dict]:
    """The kept turns (:func:`read_user_turns`) as chat-templated prompt ids, in file order,
    each at most ``max_prompt_tokens`` long; the counts gain ``too_long``."""
    texts, stats = read_user_turns(paths, tokenizer, exclude=exclude)
    encoded = [encode_user_turn(tokenizer, t) for t in texts]
    prompts = [p for p in encoded if len(p) <= max_prompt_tokens]
    return prompts, stats | {"too_long": len(encoded) - len(prompts)}


def distinct_ngrams(texts: Sequence[str], n: int = 2) -> float:
    """Distinct word n-grams over all n-grams of ``texts`` (distinct-n, Li et al., 2016): a
    diversity figure comparable between prompt sources of similar size."""
    grams = [tuple(w[i:i + n]) for t in texts for w in [t.casefold().split()]
             for i in range(len(w) - n + 1)]
    return len(set(grams)) / max(len(grams), 1)
