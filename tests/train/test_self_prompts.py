"""Prompts the target writes itself (Magpie's pre-query template): the prefix, the sampled
records, and what reading them keeps."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from specjax.train.cli import _self_written_prompts
from specjax.train.prompts import encode_user_turn, shingles
from specjax.train.self_prompts import (
    distinct_ngrams,
    pre_query,
    read_user_turns,
    write_user_turns,
)

EOS = 2


class CharTokenizer:
    """Stands in for a chat tokenizer: one id per character (ids 3 + code point % 200), a
    template with a system turn, and EOS 2 closing each turn."""

    chat_template = "{{ messages }}"
    eos_token_id = EOS

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict=False):
        text = "".join(f"<{m['role']}>{m['content']}|\n" for m in
                       [{"role": "system", "content": "be kind"}, *messages])
        text += "<assistant>" if add_generation_prompt else ""
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def encode(self, text, add_special_tokens=True):
        assert not add_special_tokens
        return [3 + ord(c) % 200 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i - 3) if i >= 3 else "?" for i in ids if i != EOS)


def test_the_pre_query_prefix_ends_where_the_users_words_begin():
    tok = CharTokenizer()
    assert pre_query(tok) == tok.encode("<system>be kind|\n<user>", add_special_tokens=False)
    base = CharTokenizer()
    base.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        pre_query(base)

    class Dropping(CharTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt, tokenize,
                                return_dict=False):
            return "<user>|\n"

    with pytest.raises(ValueError, match="verbatim"):
        pre_query(Dropping())


def _record(tok, text, finished=True):
    pre = pre_query(tok)
    turn = tok.encode(text, add_special_tokens=False) + ([EOS] if finished else [])
    return json.dumps({"tokens": pre + turn, "assistant": [0] * len(pre) + [1] * len(turn),
                       "prompt_index": 0, "finished": finished})


def test_reading_keeps_each_closed_turn_once_and_none_the_evaluation_shares(tmp_path):
    tok = CharTokenizer()
    evaluation = "the quick brown fox jumps over the lazy dog every single day"
    lines = [_record(tok, "How do I sort a list in Python?"),
             _record(tok, "Tell me a story about a dragon", finished=False),  # cut
             _record(tok, "Hi there"),  # too short
             _record(tok, "  how do I   sort a list in python?"),  # the first, folded
             _record(tok, f"Please explain why {evaluation} again"),  # the evaluation's text
             _record(tok, "What is the capital of France, and why?")]
    path = tmp_path / "turns.jsonl"
    path.write_text("\n".join(lines) + '\n{"tokens": [1, 2')  # a line a crash cut
    before = path.read_text()
    texts, stats = read_user_turns(path, tok, exclude=shingles(evaluation))
    assert path.read_text() == before  # read only: a writer may still be appending to it
    assert texts == ["How do I sort a list in Python?", "What is the capital of France, and why?"]
    assert stats == {"records": 6, "unfinished": 1, "short": 1, "duplicate": 1, "excluded": 1,
                     "kept": 2}

    class Other(CharTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt, tokenize,
                                return_dict=False):
            return super().apply_chat_template(messages, False, False).replace("kind", "nice")

    with pytest.raises(ValueError, match="another target"):
        read_user_turns(path, Other())


def test_self_distill_asks_the_kept_turns_once_within_the_limits(tmp_path):
    """`specjax train self-distill --self-prompts`: the turns reading keeps, chat-templated,
    once across files, none over --max-prompt-tokens, the first --num-prompts."""
    tok = CharTokenizer()
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join([_record(tok, "How do I sort a list in Python?"),
                            _record(tok, "Tell me a story about a dragon", finished=False),
                            _record(tok, "Write a very long poem " + "about the sea " * 20)])
                 + "\n")
    b.write_text("\n".join([_record(tok, "how do I sort a list in python?"),
                            _record(tok, "What is the capital of France, and why?")]) + "\n")
    args = argparse.Namespace(self_prompts=[str(a), str(b)], exclude=[], max_prompt_tokens=120,
                              num_prompts=10)
    prompts, source = _self_written_prompts(args, tok)
    assert prompts == [encode_user_turn(tok, "How do I sort a list in Python?"),
                       encode_user_turn(tok, "What is the capital of France, and why?")]
    assert "self-written" in source
    args.num_prompts = 1
    assert _self_written_prompts(args, tok)[0] == prompts[:1]


def test_write_samples_turns_after_the_prefix_and_resumes(tiny_target, tmp_path):
    target = dataclasses.replace(tiny_target, tokenizer=CharTokenizer())
    out = tmp_path / "turns.jsonl"
    meta = write_user_turns(target, 3, out, max_new_tokens=5, batch_size=2, engine="specjax",
                            progress=False)
    assert meta["records"] == 3 and meta["settings"]["temperature"] == 1.0
    pre = pre_query(target.tokenizer)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["tokens"][:len(pre)] == pre and r["assistant"] == [0] * len(pre) + [1] * (
        len(r["tokens"]) - len(pre)) for r in recs)
    assert recs[0]["tokens"] != recs[1]["tokens"]  # each row of a batch draws its own turn
    again = write_user_turns(target, 5, tmp_path / "more.jsonl", max_new_tokens=5,
                             batch_size=2, engine="specjax", progress=False)
    # The same seed draws the same first batch: a longer run extends a shorter one.
    more = (tmp_path / "more.jsonl").read_text().splitlines()
    assert more[:2] == out.read_text().splitlines()[:2] and again["records"] == 5
    with pytest.raises(ValueError, match="num"):
        write_user_turns(target, 0, out)


def test_distinct_bigrams():
    assert distinct_ngrams(["a b a b"]) == pytest.approx(2 / 3)
    assert distinct_ngrams(["a b", "A B"]) == 0.5
    assert distinct_ngrams([]) == 0.0
