"""A broad prompt mix for self-distillation, built from ShareGPT alone.

The drafter is used where the target answers: chat, code, questions about a given
passage, summaries of a given text, translation, math. ShareGPT's first user turns
cover chat, code and math, but rarely hand the model a text to summarise or a
passage to answer from, and its non-English turns are seldom translation requests.
The mix below derives those prompt kinds from ShareGPT's own text:

* ``chat``: a first user turn, as it is;
* ``summarize``: an English prose answer from ShareGPT as the text to summarise;
* ``passage_qa``: an English prose answer as the passage, the user turn that asked
  for it as the question (so the question is answerable from the passage);
* ``translate``: a German / French / Spanish / Italian / Portuguese paragraph of any turn,
  to English (every such paragraph: there are about 520 in ShareGPT);
* ``summarize_long`` / ``passage_qa_long``: the same two tasks over a long text, the prose
  answers of one conversation joined (350-750 words, as passages for the question). Spec-Bench's
  summarization and RAG prompts run 650-750 tokens, past every position a drafter trained on
  the short kinds (<= 320 prompt tokens) has seen. Off by default (weight 0): ask for them
  with ``--mix summarize_long=W,passage_qa_long=W --max-prompt-tokens 1024``.
* ``followup``: a later user turn with the conversation before it as context (ShareGPT's
  own answers as the earlier assistant turns), one for every later turn: text the first
  turns never give, for prompt diversity once those are used up. Off by default; the
  contexts need a long budget (``--max-prompt-tokens 1024``).

Spec-Bench's questions are the evaluation and never training data: any prompt that
shares an 8-word shingle with one of them is dropped (:func:`load_exclusions`).

The list is interleaved by kind and sorted by length inside blocks, so any prefix of
it (self-distillation resumes and may be stopped early) is a mix, and a batch of
consecutive prompts wastes little padding.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from specjax.train.data import iter_records, normalize_messages, sharegpt_path

KINDS = ("chat", "summarize", "passage_qa", "translate", "summarize_long", "passage_qa_long",
         "followup")
DEFAULT_WEIGHTS = {"chat": 0.45, "summarize": 0.2, "passage_qa": 0.2, "translate": 0.15}


def with_long_share(long_share: float) -> dict[str, float]:
    """Kind weights for :func:`prompt_mix`: ``long_share`` split evenly between the two
    long-text kinds, the rest :data:`DEFAULT_WEIGHTS`' kinds in its proportions (as two of
    Spec-Bench's six tasks give a long text, a calibration set of its lengths has a third).

    Raises:
      ValueError: ``long_share`` is outside [0, 1].
    """
    if not 0 <= long_share <= 1:
        raise ValueError(f"long_share must be in [0, 1], got {long_share}")
    short = sum(DEFAULT_WEIGHTS.values())
    return ({k: (1 - long_share) * w / short for k, w in DEFAULT_WEIGHTS.items()}
            | {"summarize_long": long_share / 2, "passage_qa_long": long_share / 2})


_SUMMARIZE = ("Summarize: {text}",
              "Summarize the following text in a few sentences.\n\n{text}",
              "Write a short summary of this text:\n{text}")
_PASSAGE_QA = ("{text}\n\nQuestion: {q}",
               "Answer the question using the passage below.\n\nPassage: {text}\n\nQuestion: {q}",
               "Read the text and answer the question.\n\n{text}\n\n{q}")
_PASSAGES_QA = ("{text}\n\nQuestion: {q}",
                "Answer the question using the passages below.\n\n{text}\n\nQuestion: {q}")
LONG_WORDS = (350, 750)  # words of a long text: ~450-1,000 tokens
_TRANSLATE = ("Translate {lang} to English: {text}",
              "Translate the following {lang} text into English.\n\n{text}")

# Every request template ({text}, {q} and {lang} are the fields), e.g. to tell shingles that
# every prompt of a kind shares from those of its text.
TEMPLATES = _SUMMARIZE + _PASSAGE_QA + _PASSAGES_QA + _TRANSLATE

# Stop-word rates tell the language of a short turn well enough to phrase a request.
_STOPWORDS = {
    "German": "und der die das ist nicht ich wir mit für ein eine auf sie es zu den von",
    "French": "le la les et est une des pour dans avec pas je vous il qui sur du au",
    "Spanish": "el los las y es una para con por que del no se lo como más pero su",
    "Italian": "il di che è per una non sono della con gli del le da si anche",
    "Portuguese": "os é uma para com não que do da em um se mais por",
}
_STOPWORDS = {lang: frozenset(words.split()) for lang, words in _STOPWORDS.items()}
_WORD = re.compile(r"[^\W\d_]+", re.UNICODE)
_ENGLISH = set(("the and is of to in that it for with as on are this be by you we a an or at "
                "from not can will what how i my your have has do if so").split())


def _language(text: str) -> str | None:
    """The language whose stop words make up >= 20% of ``text``'s words, English included."""
    words = [w.lower() for w in _WORD.findall(text)]
    if len(words) < 6:
        return None
    rates = {lang: sum(w in sw for w in words) / len(words) for lang, sw in _STOPWORDS.items()}
    rates["English"] = sum(w in _ENGLISH for w in words) / len(words)
    best = max(rates, key=rates.get)
    if best != "English" and rates["English"] >= 0.08:  # mixed text: not worth translating
        return None
    return best if rates[best] >= 0.2 else None


def _is_prose(text: str, min_words: int, max_words: int) -> bool:
    """Plain English paragraphs: no code fences or tables, a length in words."""
    if "```" in text or "|---" in text or text.count("\n") > 40:
        return False
    n = len(text.split())
    return min_words <= n <= max_words and _language(text) == "English"


def shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
    """The ``n``-word shingles of ``text`` (lower-cased letter runs; digits and punctuation
    dropped), the unit in which evaluation and held-out text is kept out of training."""
    words = [w.lower() for w in _WORD.findall(text)]
    return {tuple(words[i:i + n]) for i in range(max(0, len(words) - n + 1))}


def shares_shingle(text: str, exclude: set[tuple[str, ...]]) -> bool:
    """Whether ``text`` shares an 8-word shingle with ``exclude`` (:func:`load_exclusions`):
    how Spec-Bench's questions are kept out of training data and calibration prompts."""
    return bool(exclude) and not shingles(text).isdisjoint(exclude)


def load_exclusions(paths: Iterable[str | Path]) -> set[tuple[str, ...]]:
    """8-word shingles of every turn of the given Spec-Bench-style ``question.jsonl`` files."""
    out: set[tuple[str, ...]] = set()
    for path in paths:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if line.strip():
                for turn in json.loads(line).get("turns", []):
                    out |= shingles(turn)
    return out


def candidates(messages: list[dict[str, str]],
               kinds: Collection[str] = KINDS) -> dict[str, str]:
    """The prompt of each kind that one conversation yields (a kind may be missing):
    ``summarize`` or ``passage_qa`` from its first prose answer (:func:`passages` has them
    all); the long kinds and ``translate`` (its first paragraph; :func:`translations` has
    them all), which scan every turn, only when ``kinds`` asks for them."""
    out: dict[str, str] = {}
    user = messages[0]["content"] if messages[0]["role"] == "user" else None
    if user is not None:
        out["chat"] = user
    if found := passages(messages, first_only=True):  # the first prose answer's
        kind, prompt = found[0]
        out[kind] = prompt
    if {"summarize_long", "passage_qa_long"} & set(kinds):
        out.update(_long_candidate(_pairs(messages)))
    if "translate" in kinds and (found := translations(messages)):
        out["translate"] = found[0]
    return out


def _pairs(messages: list[dict[str, str]]) -> list[tuple[str, str]]:
    """Each (user turn, the assistant turn answering it) of a conversation."""
    return [(q["content"], a["content"]) for q, a in zip(messages, messages[1:], strict=False)
            if q["role"] == "user" and a["role"] == "assistant"]


def passages(messages: list[dict[str, str]],
             first_only: bool = False) -> list[tuple[str, str]]:
    """A ``summarize`` or ``passage_qa`` prompt (kind, text) for every answer of a
    conversation that is English prose of 60-300 words; the question of ``passage_qa`` is
    the user turn it answered.

    Each passage serves one kind (fixed by its text's hash, run to run), so the two kinds
    never share a text. All of them, as for :func:`translations`: ShareGPT's records before
    the calibration range hold about 25,600 such answers in 9,500 conversations; one a
    conversation gave the two kinds 4,384 prompts of up to 320 tokens, all of them 12,288.
    """
    out = []
    for question, answer in _pairs(messages):
        if not _is_prose(answer, 60, 300):
            continue
        h = zlib.crc32(answer.encode())
        if h % 2 and 3 <= len(question.split()) <= 40 and "\n" not in question.strip():
            out.append(("passage_qa", _PASSAGE_QA[h % len(_PASSAGE_QA)].format(
                text=answer.strip(), q=question.strip())))
        else:
            out.append(("summarize", _SUMMARIZE[h % len(_SUMMARIZE)].format(
                text=answer.strip())))
        if first_only:
            break
    return out


def translations(messages: list[dict[str, str]]) -> list[str]:
    """A translation request for every non-English paragraph of any turn (answers in
    German, French, ... are far more common in ShareGPT than short non-English questions).

    All of them, not one a conversation as for the other kinds: ShareGPT here holds about
    520 such paragraphs in some 170 conversations, so one a conversation left translation at
    0.4% of a mix that asked for 15%."""
    out = []
    for m in messages:
        for para in m["content"].split("\n\n"):
            if 8 <= len(para.split()) <= 80 and "```" not in para and para.count("\n") <= 3:
                lang = _language(para)
                if lang not in (None, "English"):
                    template = _TRANSLATE[zlib.crc32(para.encode()) % len(_TRANSLATE)]
                    prompt = template.format(lang=lang, text=para.strip())
                    if prompt not in out:  # a paragraph quoted back in a later turn
                        out.append(prompt)
    return out


def followups(messages: list[dict[str, str]], min_words: int = 3) -> list[list[dict[str, str]]]:
    """The conversation up to each later user turn (of ``min_words`` words or more), the
    turns before it as they are: one prompt of the ``followup`` kind each."""
    return [messages[:i + 1] for i in range(2, len(messages))
            if messages[i]["role"] == "user" and messages[i - 1]["role"] == "assistant"
            and len(messages[i]["content"].split()) >= min_words]


def _long_candidate(pairs: list[tuple[str, str]]) -> dict[str, str]:
    """``summarize_long`` or ``passage_qa_long`` (never both) from a conversation's first
    consecutive prose answers, joined while they fit in :data:`LONG_WORDS` (two at least)."""
    lo, hi = LONG_WORDS
    taken: list[tuple[str, str]] = []  # a run of consecutive prose answers, of `words` words
    words = 0
    for question, answer in pairs:
        n = len(answer.split())
        if not _is_prose(answer, 60, 600):
            if words >= lo:
                break
            taken, words = [], 0
            continue
        if words + n > hi:
            break
        taken.append((question.strip(), answer.strip()))
        words += n
    if len(taken) < 2 or words < lo:
        return {}
    h = zlib.crc32("".join(a for _, a in taken).encode())
    questions = [q for q, _ in taken if 3 <= len(q.split()) <= 40 and "\n" not in q]
    if h % 2 and questions:
        text = "\n\n".join(f"Passage {i + 1}: {a}" for i, (_, a) in enumerate(taken))
        return {"passage_qa_long": _PASSAGES_QA[h % len(_PASSAGES_QA)].format(
            text=text, q=questions[h % len(questions)])}
    text = "\n\n".join(a for _, a in taken)
    return {"summarize_long": _SUMMARIZE[h % len(_SUMMARIZE)].format(text=text)}


def prompt_text(item: str | list[dict[str, str]]) -> str:
    """The text a prompt's shingles are taken from: a user turn's, or every turn of a
    ``followup`` conversation's."""
    return item if isinstance(item, str) else "\n\n".join(m["content"] for m in item)


def encode_prompt(tokenizer: Any, item: str | list[dict[str, str]]) -> list[int]:
    """A user turn (:func:`encode_user_turn`) or a conversation (:func:`encode_conversation`)
    as prompt ids."""
    return (encode_user_turn(tokenizer, item) if isinstance(item, str)
            else encode_conversation(tokenizer, item))


def encode_conversation(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """A conversation ending with a user turn, chat-templated with the generation prompt."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("followup prompts need a chat template; this tokenizer has none "
                         "(a base model): leave the followup kind out of the mix")
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


def encode_user_turn(tokenizer: Any, text: str) -> list[int]:
    """One user turn as a prompt: chat-templated with the generation prompt, or plain text
    (the tokenizer's BOS first) for a base model, whose tokenizer has no template."""
    if getattr(tokenizer, "chat_template", None) is None:
        return list(tokenizer.encode(text))
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def prompt_mix(tokenizer: Any, *, num: int, skip: int = 2000, max_prompt_tokens: int = 320,
               weights: Mapping[str, float] | None = None, source: str | Path = "sharegpt",
               exclude: set[tuple[str, ...]] | None = None, block: int = 192,
               seed: int = 0, end: int | None = None,
               every_passage: bool = False) -> tuple[list[list[int]], list[str], dict]:
    """``num`` chat-templated prompts drawn from ``source`` after ``skip`` records.

    A kind whose candidates are rare (translate) keeps the scan going after the others are
    full, so without ``end`` it reads to the end of the source; ``end`` stops it there
    (training data passes :data:`specjax.train.data.CALIBRATION_START`, so it never takes
    a prompt from the records `bench spec` calibrates on).

    Args:
      weights: share of each kind (default :data:`DEFAULT_WEIGHTS`); a kind that runs
        out of candidates leaves its share to the others.
      exclude: shingles of evaluation questions (:func:`load_exclusions`); a prompt
        sharing one is dropped.
      block: prompts are sorted by length inside consecutive blocks of this size.
      every_passage: the given-text kinds take every prose answer of a conversation
        (:func:`passages`), not only its first; False keeps the prompt sets made before it
        (bench calibration, the drafters' held-out prompts) as they were.
    Returns:
      (prompt ids, their kinds, stats) in generation order; each prompt ends with the
      assistant header and has at most ``max_prompt_tokens`` tokens.
    """
    weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
    if unknown := set(weights) - set(KINDS):
        raise ValueError(f"unknown prompt kinds {sorted(unknown)}; known: {KINDS}")
    quota = {k: round(num * w / sum(weights.values())) for k, w in weights.items() if w > 0}
    pools: dict[str, list[list[int]]] = {k: [] for k in quota}
    stats = {"records": 0, "excluded": 0, "too_long": 0}
    path = sharegpt_path() if str(source) == "sharegpt" else Path(source)
    for i, rec in enumerate(iter_records(path)):
        if end is not None and i >= end:
            break
        if i < skip:
            continue
        stats["records"] += 1
        msgs = normalize_messages(rec)
        if not msgs:
            continue
        found: list[tuple[str, Any]] = list(
            candidates(msgs, [k for k in pools if k != "translate"]).items())
        if every_passage:  # every prose answer, not only the first (see passages)
            found = [kc for kc in found if kc[0] not in ("summarize", "passage_qa")]
            found += passages(msgs)
        if "translate" in pools:  # every paragraph, not only the first (see translations)
            found += [("translate", t) for t in translations(msgs)]
        if "followup" in pools:  # a list of messages, not a user turn's text
            found += [("followup", f) for f in followups(msgs)]
        for kind, item in found:
            if kind not in pools or len(pools[kind]) >= quota[kind]:
                continue
            if shares_shingle(prompt_text(item), exclude):
                stats["excluded"] += 1
                continue
            ids = encode_prompt(tokenizer, item)
            if len(ids) > max_prompt_tokens:
                stats["too_long"] += 1
                continue
            pools[kind].append(list(ids))
        if all(len(pools[k]) >= quota[k] for k in pools):
            break
    # Interleave by kind (largest remaining share first), then sort blocks by length.
    order: list[tuple[str, list[int]]] = []
    taken = dict.fromkeys(pools, 0)
    while len(order) < sum(map(len, pools.values())):
        left = [k for k in pools if taken[k] < len(pools[k])]
        k = min(left, key=lambda k: (taken[k] + 1) / len(pools[k]))
        order.append((k, pools[k][taken[k]]))
        taken[k] += 1
    rng = random.Random(seed)
    out: list[tuple[str, list[int]]] = []
    for start in range(0, len(order), block):
        chunk = order[start:start + block]
        rng.shuffle(chunk)
        out += sorted(chunk, key=lambda kp: len(kp[1]))
    stats["per_kind"] = {k: len(v) for k, v in pools.items()}
    return [p for _, p in out], [k for k, _ in out], stats
