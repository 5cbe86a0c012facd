"""Spec-Bench questions: where the file is, how it reads, which questions a run takes.

Spec-Bench (hemingkx/Spec-Bench, ``data/spec_bench/question.jsonl``) holds MT-bench's 80
questions in 8 categories plus 80 of each of five tasks. The benchmarks here use the first
turn of each question and group MT-bench's categories into one task, ``mt_bench``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import specjax

MT_BENCH_CATEGORIES = frozenset({"writing", "roleplay", "reasoning", "math", "coding",
                                 "extraction", "stem", "humanities"})
TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
QUESTIONS_ENV = "SPECJAX_SPEC_BENCH"


@dataclasses.dataclass(frozen=True)
class Question:
    """One Spec-Bench question (its first turn only)."""

    question_id: int
    task: str  # "mt_bench" for MT-bench's 8 categories, else the category
    category: str
    text: str


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
            cat = q["category"]
            out.append(Question(int(q["question_id"]),
                                "mt_bench" if cat in MT_BENCH_CATEGORIES else cat, cat,
                                q["turns"][0]))
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a Spec-Bench question ({e!r})") from None
    return out


def select_questions(questions: Sequence[Question], tasks: Sequence[str], per_task: int,
                     *, last: bool = False,
                     exclude: frozenset[int] = frozenset()) -> list[Question]:
    """The first (or ``last``) ``per_task`` questions of each task, grouped by task."""
    out = []
    for task in tasks:
        pool = [q for q in questions if q.task == task and q.question_id not in exclude]
        if not pool:
            known = sorted({q.task for q in questions})
            raise ValueError(f"no questions for task {task!r}; tasks are {known}")
        out += pool[-per_task:] if last else pool[:per_task]
    return out


def spec_bench_prompts(target: Any, *, questions: str | Path | None, tasks: Sequence[str],
                       per_task: int, calib_tasks: Sequence[str], calib_per_task: int,
                       prompts: Sequence[dict[str, Any]] | None = None,
                       calib_prompts: Sequence[Sequence[int]] | None = None
                       ) -> tuple[list[dict[str, Any]], list[int] | None, list[list[int]],
                                  Path | None]:
    """(evaluation prompts, calibration question ids, calibration ids, questions file).

    The first ``per_task`` questions of each task through the chat template, and the last
    ``calib_per_task`` of each calibration task outside them (a benchmark never tunes on
    what it evaluates); or, for tests, given pre-tokenised ``prompts``
    (``{"question_id", "task", "ids"}``) and ``calib_prompts``.
    """
    from specjax.api import encode_prompts

    if prompts is None:
        qpath = resolve_questions(questions)
        qs = load_questions(qpath)
        chosen = select_questions(qs, tasks, per_task)
        evals = [{"question_id": q.question_id, "task": q.task, "category": q.category,
                  "ids": encode_prompts(target, q.text, chat=True)[0]} for q in chosen]
        calib = select_questions(qs, calib_tasks, calib_per_task, last=True,
                                 exclude=frozenset(q.question_id for q in chosen))
        return (evals, [q.question_id for q in calib],
                [encode_prompts(target, q.text, chat=True)[0] for q in calib], qpath)
    if calib_prompts is None:
        raise ValueError("pre-tokenised prompts need calib_prompts too")
    evals = [{"question_id": int(p["question_id"]), "task": p["task"],
              "category": p.get("category", p["task"]), "ids": list(map(int, p["ids"]))}
             for p in prompts]
    return evals, None, [list(map(int, p)) for p in calib_prompts], None
