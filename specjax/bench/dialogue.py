"""Long conversations as a request stream: EvoSpec's appendix F, on ShareGPT.

The paper's long-horizon test replays real multi-turn traces (LMSYS-Chat-1M conversations of
more than 50 turns) and reports MAL over each whole trajectory: the setting where a session's
state (buffer, LoRA) meets text that keeps to one user's topic and style. Here the traces are
the user turns of long ShareGPT conversations past the held-out record (LMSYS-Chat-1M does
not install here), sent in order, each request the conversation so far with the *target's
own* earlier replies (as ``specjax chat`` renders it), not ShareGPT's.

``bench evospec --domains dialogue:code,dialogue:legal`` plays conversations of one topic
and then of another the same way (``first_turn``): the issue's topic switch, as
conversations rather than single prompts.

A 135M target has a small context and a CPU pays for every prompt row, so a request keeps
the newest exchanges that fit in ``max_tokens`` (older user / reply pairs are dropped
whole, as a chat front end does) and a turn longer than ``turn_tokens`` is skipped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

MIN_TURNS = 10  # user turns a conversation needs to be a trace
MAX_TOKENS = 1536  # the rendered conversation of one request
TURN_TOKENS = 256  # one user turn


@dataclasses.dataclass(frozen=True)
class Turn:
    """One request of a trace: the ``index``-th kept user turn (those :func:`traces` does not
    leave out) of ShareGPT record ``record``."""

    record: int
    index: int
    text: str


def traces(tokenizer: Any, n: int, *, skip: int, exclude: set, min_turns: int = MIN_TURNS,
           turn_tokens: int = TURN_TOKENS, first_turn: Callable[[str], bool] | None = None
           ) -> list[Turn]:
    """The first ``n`` user turns of the conversations from ShareGPT record ``skip`` on that
    have ``min_turns`` user turns or more, conversation by conversation and in order (the
    last conversation may be cut). A turn of fewer than 3 words, longer than
    ``turn_tokens``, or sharing an 8-word shingle with ``exclude`` (Spec-Bench) is left out.
    ``first_turn``, if given, keeps only the conversations whose first user message (as
    written, before any turn is left out) it accepts: a topic filter.
    """
    from specjax.train.data import sharegpt_conversations
    from specjax.train.prompts import shares_shingle

    out: list[Turn] = []
    for i, msgs in sharegpt_conversations(skip):
        users = [m["content"] for m in msgs if m["role"] == "user"]
        if first_turn is not None and not (users and first_turn(users[0])):
            continue
        turns = [t for t in users if len(t.split()) >= 3 and not shares_shingle(t, exclude)
                 and len(tokenizer.encode(t)) <= turn_tokens]
        if len(turns) < min_turns:
            continue
        out += [Turn(i, k, t) for k, t in enumerate(turns)][: n - len(out)]
        if len(out) == n:
            return out
    of = " of the topic" if first_turn is not None else ""
    raise ValueError(f"ShareGPT has only {len(out)} turns of conversations{of} with "
                     f"{min_turns}+ user turns after record {skip}; lower --per-domain")


class Histories:
    """Each trace's conversation so far, with the target's replies; renders a turn's prompt."""

    def __init__(self, tokenizer: Any, max_tokens: int = MAX_TOKENS) -> None:
        self.tokenizer, self.max_tokens = tokenizer, max_tokens
        self.turns: dict[int, list[dict[str, str]]] = {}

    def prompt(self, turn: Turn) -> list[list[int]]:
        """The chat-templated ids (a batch of one) of ``turn`` after its conversation so far,
        the oldest exchanges dropped until it fits in ``max_tokens``."""
        from specjax.train.prompts import encode_conversation

        past = self.turns.get(turn.record, [])
        for start in range(0, len(past) + 1, 2):  # whole user / reply pairs
            ids = encode_conversation(self.tokenizer,
                                      [*past[start:], {"role": "user", "content": turn.text}])
            if len(ids) <= self.max_tokens:
                return [ids]
        raise ValueError(f"turn {turn.index} of record {turn.record} alone is over "
                         f"{self.max_tokens} tokens")

    def record(self, turn: Turn, reply: str) -> None:
        """Append ``turn`` and the target's ``reply`` (its text) to the conversation."""
        self.turns.setdefault(turn.record, []).extend(
            [{"role": "user", "content": turn.text}, {"role": "assistant", "content": reply}])
