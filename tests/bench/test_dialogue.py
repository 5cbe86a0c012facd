"""bench evospec's dialogue stream: which turns make a trace, and how a turn is rendered."""

from __future__ import annotations

import json

import pytest

from specjax.bench.dialogue import Histories, Turn, traces


class Chat:
    """One id per word, a header id (1) per message; tokens are words."""

    chat_template = "{{ turns }}"

    def encode(self, text: str) -> list[str]:
        return text.split()

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        return [i for m in messages for i in [1] + [2] * len(m["content"].split())]


@pytest.fixture
def sharegpt(tmp_path, monkeypatch):
    import specjax.train.data

    def conversation(i: int, turns: int) -> dict:
        msgs = []
        for k in range(turns):
            text = f"record {i} turn {k} asks this"
            if k == 1:
                text = "ok"  # under 3 words: not a turn
            if k == 2 and i == 1:
                text = "a very long turn " * 10  # 40 words: over turn_tokens
            msgs += [{"from": "human", "value": text}, {"from": "gpt", "value": "fine."}]
        return {"conversations": msgs}

    records = [conversation(0, 3), conversation(1, 6), conversation(2, 5)]
    src = tmp_path / "sharegpt.json"
    src.write_text(json.dumps(records))
    monkeypatch.setattr(specjax.train.data, "sharegpt_path", lambda: src)


def test_traces_are_long_conversations_turn_by_turn(sharegpt):
    got = traces(Chat(), 7, skip=0, exclude=set(), min_turns=4, turn_tokens=30)
    # Record 0 has 2 usable turns and record 1 four (turn 1 too short, turn 2 too long), so
    # record 1 is the first trace; record 2 gives the rest, cut at 7 turns in all.
    assert [(t.record, t.index) for t in got] == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0),
                                                   (2, 1), (2, 2)]
    assert got[1].text == "record 1 turn 3 asks this"
    with pytest.raises(ValueError, match="only 8 turns of conversations with 4\\+ user turns"):
        traces(Chat(), 9, skip=0, exclude=set(), min_turns=4, turn_tokens=30)
    assert traces(Chat(), 4, skip=2, exclude=set(), min_turns=4, turn_tokens=30)[0].record == 2


def test_a_first_turn_filter_keeps_a_topics_conversations(sharegpt):
    # The filter sees each conversation's first user message as written: record 2's.
    got = traces(Chat(), 4, skip=0, exclude=set(), min_turns=4, turn_tokens=30,
                 first_turn=lambda text: text.startswith("record 2 "))
    assert [(t.record, t.index) for t in got] == [(2, 0), (2, 1), (2, 2), (2, 3)]
    with pytest.raises(ValueError, match="only 4 turns of conversations of the topic"):
        traces(Chat(), 5, skip=0, exclude=set(), min_turns=4, turn_tokens=30,
               first_turn=lambda text: text.startswith("record 2 "))


def test_a_turn_follows_the_targets_replies_and_drops_whole_old_exchanges():
    h = Histories(Chat(), max_tokens=20)
    first = Turn(7, 0, "one two three")
    assert h.prompt(first) == [[1, 2, 2, 2]]
    h.record(first, "reply of four words")
    second = Turn(7, 1, "four five six")
    assert h.prompt(second) == [[1, 2, 2, 2, 1, 2, 2, 2, 2, 1, 2, 2, 2]]  # 13 ids
    h.record(second, "another reply of five words")
    # 4 + 5 + 4 + 6 + 4 = 23 > 20: the first exchange goes, whole.
    third = Turn(7, 2, "seven eight nine")
    assert h.prompt(third) == [[1, 2, 2, 2, 1, 2, 2, 2, 2, 2, 1, 2, 2, 2]]
    assert h.prompt(Turn(8, 0, "other conversation")) == [[1, 2, 2]]  # its own history
    with pytest.raises(ValueError, match="turn 0 of record 9 alone is over 20 tokens"):
        h.prompt(Turn(9, 0, "word " * 30))
