"""The self-distillation prompt mix: kinds derived from ShareGPT-style records, exclusions."""

from __future__ import annotations

import json
import zlib

import pytest

from specjax.train.prompts import (
    DEFAULT_WEIGHTS,
    candidates,
    followups,
    load_exclusions,
    passages,
    prompt_mix,
    translations,
    with_long_share,
)

PROSE = ("The water cycle moves water between the oceans, the air and the land. Heat from the "
         "sun makes water evaporate from the sea, and the vapour rises and cools into clouds. "
         "When the droplets grow heavy they fall as rain or snow, which runs into rivers and "
         "lakes or soaks into the ground, and in the end it flows back to the sea, where the "
         "cycle begins again. Plants also return water to the air through their leaves.")
GERMAN = ("Die Krise ist in der Mittelschicht angekommen, und viele Familien müssen jetzt mit "
          "weniger Geld auskommen als früher.")


class WordTokenizer:
    """Stands in for a chat tokenizer: one id per whitespace word, plus a 2-token header."""

    chat_template = "{{ words }}"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        assert add_generation_prompt and tokenize and len(messages) == 1
        return [1] + [10 + zlib.crc32(w.encode()) % 1000
                      for w in messages[0]["content"].split()] + [2]


def _conv(*turns):
    return {"conversations": [{"from": w, "value": v} for w, v in turns]}


def test_candidates_derive_each_kind():
    c = candidates([{"role": "user", "content": "How does the water cycle work?"},
                    {"role": "assistant", "content": PROSE}])
    assert c["chat"] == "How does the water cycle work?"
    assert ("summarize" in c) != ("passage_qa" in c)  # one passage, one kind
    kind = "summarize" if "summarize" in c else "passage_qa"
    assert PROSE in c[kind]
    t = candidates([{"role": "user", "content": "Bitte übersetze das."},
                    {"role": "assistant", "content": "Klar.\n\n" + GERMAN}])
    assert t["translate"].startswith("Translate") and "German" in t["translate"]
    assert GERMAN in t["translate"]
    # Code and English text are never offered for translation.
    assert "translate" not in candidates([{"role": "user", "content": PROSE},
                                          {"role": "assistant", "content": "ok " * 10}])


def test_prompt_mix_interleaves_kinds_and_drops_evaluation_questions(tmp_path):
    evaluation = "Who played the part of Anna in the series once upon a time?"
    records = [_conv(("human", evaluation), ("gpt", PROSE))]
    for i in range(60):
        q = f"Question number {i}: how does the water cycle work in region {i}?"
        records.append(_conv(("human", q), ("gpt", PROSE.replace("sun", f"sun {i}"))))
        records.append(_conv(("human", f"Schreib etwas {i}"), ("gpt", GERMAN + f" {i}")))
    src = tmp_path / "sg.json"
    src.write_text(json.dumps(records))
    questions = tmp_path / "question.jsonl"
    questions.write_text(json.dumps({"turns": [evaluation]}) + "\n")
    prompts, kinds, stats = prompt_mix(WordTokenizer(), num=40, skip=0, source=src,
                                       max_prompt_tokens=10_000,
                                       exclude=load_exclusions([questions]), block=8)
    assert len(prompts) == len(kinds) == 40
    assert set(kinds) == {"chat", "summarize", "passage_qa", "translate"}
    assert stats["excluded"] >= 1
    banned = WordTokenizer().apply_chat_template([{"role": "user", "content": evaluation}],
                                                 True, True, False)
    assert banned not in prompts
    # Every block of 8 holds several kinds and is sorted by length.
    for s in range(0, 40, 8):
        assert len(set(kinds[s:s + 8])) >= 2
        lens = [len(p) for p in prompts[s:s + 8]]
        assert lens == sorted(lens)
    with pytest.raises(ValueError, match="unknown prompt kinds"):
        prompt_mix(WordTokenizer(), num=4, source=src, weights={"poetry": 1.0})


def test_every_non_english_paragraph_is_a_translation_prompt(tmp_path):
    """Translation candidates are rare, so a conversation gives one for each paragraph
    (a paragraph quoted again counts once), not one for the conversation."""
    other = GERMAN.replace("Krise", "Lage").replace("Familien", "Leute")
    msgs = [{"role": "user", "content": GERMAN + "\n\n" + other},
            {"role": "assistant", "content": "ok\n\n" + GERMAN}]
    found = translations(msgs)
    assert len(found) == 2 and GERMAN in found[0] and other in found[1]
    assert candidates(msgs)["translate"] == found[0]
    src = tmp_path / "sg.json"
    src.write_text(json.dumps([_conv(("human", GERMAN + "\n\n" + other), ("gpt", "ok"))]))
    _, kinds, _ = prompt_mix(WordTokenizer(), num=4, skip=0, source=src,
                             max_prompt_tokens=10_000, weights={"translate": 1.0})
    assert kinds == ["translate", "translate"]


def test_every_prose_answer_is_a_passage_when_asked(tmp_path):
    """A conversation gives a given-text prompt for each prose answer with
    ``every_passage``; without it, only its first, so the prompt sets made before (bench
    calibration, held-out prompts) stay as they were."""
    prose = [PROSE.replace("sun", f"sun {i}") for i in range(3)]
    msgs = []
    for i, text in enumerate(prose):
        msgs += [{"role": "user", "content": f"How does water move, part {i}?"},
                 {"role": "assistant", "content": text}]
    msgs.insert(2, {"role": "user", "content": "thanks"})  # a turn with no answer of prose
    msgs.insert(3, {"role": "assistant", "content": "You are welcome."})
    found = passages(msgs)
    assert len(found) == 3 and all(text in p for (_, p), text in zip(found, prose, strict=True))
    assert {k for k, _ in found} <= {"summarize", "passage_qa"}
    assert passages(msgs, first_only=True) == found[:1]
    kind, prompt = found[0]
    assert candidates(msgs)[kind] == prompt
    src = tmp_path / "sg.json"
    turns = [("human" if m["role"] == "user" else "gpt", m["content"]) for m in msgs]
    src.write_text(json.dumps([_conv(*turns)]))
    given = {"summarize": 1.0, "passage_qa": 1.0}
    kw = {"num": 10, "skip": 0, "source": src, "max_prompt_tokens": 10_000, "weights": given}
    _, kinds, _ = prompt_mix(WordTokenizer(), **kw)
    assert len(kinds) == 1
    _, kinds, _ = prompt_mix(WordTokenizer(), **kw, every_passage=True)
    assert sorted(kinds) == sorted(k for k, _ in found)


def test_prompt_mix_stops_at_end_so_training_never_reads_the_calibration_records(tmp_path):
    """A rare kind (translate) keeps the scan going after the others are full; ``end`` stops
    it, so self-distillation never takes a prompt from `bench spec`'s calibration records."""
    from specjax.bench.questions import CALIB_SKIP
    from specjax.train.data import CALIBRATION_START

    assert CALIBRATION_START == CALIB_SKIP
    records = [_conv(("human", f"Question {i}: how does the water cycle work?"),
                     ("gpt", PROSE)) for i in range(6)]
    records.append(_conv(("human", "Schreib etwas"), ("gpt", GERMAN)))  # record 6
    src = tmp_path / "sg.json"
    src.write_text(json.dumps(records))
    kw = dict(num=4, skip=0, source=src, max_prompt_tokens=10_000,
              weights={"chat": 1.0, "translate": 1.0})
    _, kinds, stats = prompt_mix(WordTokenizer(), **kw)
    assert "translate" in kinds and stats["records"] == 7
    _, kinds, stats = prompt_mix(WordTokenizer(), **kw, end=6)
    assert "translate" not in kinds and stats["records"] == 6


def _long_conv(n_answers: int, tag: str = "") -> list[dict[str, str]]:
    """A multi-turn conversation whose answers are distinct ~70-word prose passages."""
    msgs = []
    for i in range(n_answers):
        msgs.append({"role": "user", "content": f"Tell me more about the water cycle, part {i}?"})
        msgs.append({"role": "assistant", "content": PROSE.replace("sun", f"sun {tag}{i}")})
    return msgs


def test_long_kinds_join_a_run_of_prose_answers_within_the_word_range():
    from specjax.train.prompts import LONG_WORDS

    lo, hi = LONG_WORDS
    per = len(PROSE.split()) + 1
    short = candidates(_long_conv(lo // per - 1))
    assert not {"summarize_long", "passage_qa_long"} & set(short)  # under lo words: none
    seen = set()
    for tag in "abcdefgh":
        msgs = _long_conv(12, tag)  # more answers than fit: the first run that fits is taken
        c = candidates(msgs)
        (kind,) = {"summarize_long", "passage_qa_long"} & set(c)  # never both
        seen.add(kind)
        text = c[kind]
        joined = [m["content"] for m in msgs[1::2] if m["content"] in text]
        assert joined == [m["content"] for m in msgs[1::2]][:len(joined)]  # a prefix, in order
        assert lo <= sum(len(a.split()) for a in joined) <= hi
        assert len(joined) >= 2
        if kind == "passage_qa_long":
            assert "Passage 1:" in text and text.split("Question: ")[-1].startswith("Tell me")
    assert seen == {"summarize_long", "passage_qa_long"}
    # A code answer breaks the run: the texts on either side are never joined.
    broken = _long_conv(3, "x") + [{"role": "user", "content": "code?"},
                                   {"role": "assistant", "content": "```py\nx = 1\n```"}]
    assert not {"summarize_long", "passage_qa_long"} & set(candidates(broken + _long_conv(2)))


def test_long_kinds_are_off_in_the_default_mix(tmp_path):
    records = [_conv(*[(w, v) for m in _long_conv(8, str(i)) for w, v in
                       [("human" if m["role"] == "user" else "gpt", m["content"])]])
               for i in range(6)]
    src = tmp_path / "sg.json"
    src.write_text(json.dumps(records))
    _, kinds, _ = prompt_mix(WordTokenizer(), num=4, skip=0, source=src,
                             max_prompt_tokens=10_000)
    assert not {"summarize_long", "passage_qa_long"} & set(kinds)
    _, kinds, _ = prompt_mix(WordTokenizer(), num=4, skip=0, source=src,
                             max_prompt_tokens=10_000,
                             weights={"summarize_long": 1.0, "passage_qa_long": 1.0})
    assert set(kinds) <= {"summarize_long", "passage_qa_long"} and len(kinds) == 4


class ChatTokenizer:
    """A multi-turn stand-in: one id per whitespace word, a header id per turn."""

    chat_template = "{{ turns }}"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        assert add_generation_prompt and tokenize
        return [i for m in messages for i in [1 if m["role"] == "user" else 3]
                + [10 + zlib.crc32(w.encode()) % 1000 for w in m["content"].split()]] + [2]


@pytest.mark.parametrize("share", [0.0, 1 / 3, 1.0])
def test_with_long_share_gives_the_long_kinds_their_share(share):
    w = with_long_share(share)
    assert sum(w.values()) == pytest.approx(1.0)
    assert w["summarize_long"] + w["passage_qa_long"] == pytest.approx(share)
    # The short kinds keep the self-distillation mix's proportions.
    for kind, weight in DEFAULT_WEIGHTS.items():
        assert w[kind] == pytest.approx((1 - share) * weight / sum(DEFAULT_WEIGHTS.values()))


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_with_long_share_refuses_a_share_outside_0_1(share):
    with pytest.raises(ValueError, match="long_share must be in"):
        with_long_share(share)


def test_followups_are_every_later_user_turn_with_its_context():
    msgs = [{"role": "user", "content": "How does the water cycle work?"},
            {"role": "assistant", "content": PROSE},
            {"role": "user", "content": "continue"},  # under 3 words: not a prompt
            {"role": "assistant", "content": "Rain falls."},
            {"role": "user", "content": "And what role do plants play in it?"},
            {"role": "assistant", "content": "They return water."}]
    (f,) = followups(msgs)
    assert f == msgs[:5] and f[-1]["role"] == "user"


def test_followup_kind_in_the_mix_keeps_evaluation_text_out_of_its_context(tmp_path):
    evaluation = "Who played the part of Anna in the series once upon a time?"
    records = [_conv(("human", "Tell me something."), ("gpt", evaluation),  # in the context
                     ("human", "Tell me more about that please."), ("gpt", "ok"))]
    for i in range(6):
        records.append(_conv(("human", f"Tell me about rivers {i}."), ("gpt", PROSE),
                             ("human", f"And what about lakes number {i}?"), ("gpt", "ok")))
    src = tmp_path / "sg.json"
    src.write_text(json.dumps(records))
    questions = tmp_path / "question.jsonl"
    questions.write_text(json.dumps({"turns": [evaluation]}) + "\n")
    excl = load_exclusions([questions])
    prompts, kinds, stats = prompt_mix(ChatTokenizer(), num=4, skip=0, source=src,
                                       weights={"followup": 1.0}, exclude=excl,
                                       max_prompt_tokens=10_000)
    assert kinds == ["followup"] * 4 and stats["excluded"] == 1
    assert all(p.count(1) == 2 and p.count(3) == 1 for p in prompts)  # user, answer, user
    _, kinds, _ = prompt_mix(ChatTokenizer(), num=4, skip=0, source=src,
                             max_prompt_tokens=10_000)
    assert "followup" not in kinds  # off by default
    base = ChatTokenizer()
    base.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        prompt_mix(base, num=4, skip=0, source=src, weights={"followup": 1.0},
                   max_prompt_tokens=10_000)
