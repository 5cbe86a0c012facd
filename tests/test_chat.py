"""``specjax chat``: turns keep the conversation and the EvoSpec buffer."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
from flax import nnx

import specjax
from specjax.commands.chat import chat_loop, turn_line
from specjax.drafter import DrafterConfig, EagleDrafter
from specjax.loaded import Drafter
from specjax.speculative import TreeSpec
from specjax.vocab.arc import ArcConfig
from specjax.vocab.evospec import evospec_head
from tests.tiny import make_hf_checkpoint
from tests.vocab.conftest import toy_tokenizer


def _chat(tmp_path, text, online=None):
    """Run chat_loop on a tiny target with an EvoSpec head and LoRA; (turns, bracketed lines)."""
    src = make_hf_checkpoint(tmp_path / "hf", "llama")
    toy_tokenizer().save_pretrained(src)  # a word-level tokenizer with a ChatML template
    target = specjax.load(specjax.convert(src, tmp_path / "sj", progress=False))
    model = EagleDrafter(DrafterConfig(target.cfg), rngs=nnx.Rngs(0))
    drafter = Drafter(cfg=model.cfg, params=model.params())
    v = target.cfg.vocab_size
    head = evospec_head(target.params.head, np.arange(v), [0, 1, 2, 3], v // 8, n_dyn=v // 8,
                        arc=ArcConfig(capacity=v // 8, ghost=v // 8, p_init=v // 16, warmup=2,
                                      min_residency=1, max_insert=8))
    out, err = io.StringIO(), io.StringIO()
    turns = chat_loop(target, drafter,
                      {"max_new_tokens": 8, "tree": TreeSpec("chain", depth=2), "vocab": head,
                       "stop_on_eos": False},
                      None, io.StringIO(text), out, err, adapt=True, online=online)
    lines = [ln.removeprefix("> ") for ln in err.getvalue().splitlines()]
    return turns, [ln for ln in lines if ln.startswith("[")]


def test_turns_carry_the_buffer_and_print_per_turn_lines(tmp_path):
    turns, lines = _chat(tmp_path, "hello\nthe cat sat\n/reset\nhi\n\n")
    assert turns == 3
    assert len(lines) == 4 and "reset" in lines[2]
    assert all("tokens per target forward" in ln and "buffer" in ln and "LoRA updates" in ln
               for ln in lines[:2] + lines[3:])


def test_a_new_conversation_starts_from_what_a_new_session_knows(tmp_path):
    text = "hello the cat\nthe cat sat on the mat\nsat the cat\n/new\nhello the cat\n\n"
    turns, lines = _chat(tmp_path, text)
    assert turns == 4 and "new conversation" in lines[3]

    def same(line):  # without the speed, and the update count that goes on across /new
        return re.sub(r"[\d.]+ tok/s|LoRA updates \d+", "", line)

    # The same first turn, from zero deltas and an empty buffer: the same acceptance and events.
    assert same(lines[4]) == same(lines[0])
    assert "evicted 0" not in lines[2]  # the full buffer had turned over before /new


def test_a_guarded_chat_says_which_drafter_drafts_the_next_turn(tmp_path):
    from specjax.train.online import OnlineConfig

    online = OnlineConfig(rank=4, buffer=4, lr=1e-2, guard=True)
    turns, lines = _chat(tmp_path, "hello the cat\nthe cat sat on the mat\n\n", online)
    assert turns == 2
    # After the first turn the adapter is zero deltas: a tie, so the frozen drafter drafts.
    assert lines[0].endswith("next turn: frozen drafter (guard)]")
    assert re.search(r"next turn: (adapter|frozen drafter \(guard\))]$", lines[1])


def test_chat_adapts_at_the_measured_setting():
    import argparse

    from specjax.commands.chat import add_parser

    p = add_parser(argparse.ArgumentParser().add_subparsers())
    args = p.parse_args(["--adapt", "lora"])
    assert (args.lora_lr, args.steps_per_update, args.guard) == (1e-3, 8, False)
    assert p.parse_args(["--guard"]).guard
    # A bad setting is refused before any model loads (this one does not exist).
    bad = p.parse_args(["--model", "/nonexistent", "--adapt", "lora", "--lora-lr", "0"])
    with pytest.raises(ValueError, match="--lora-lr > 0, got 8 and 0.0"):
        bad.run(bad)


def test_turn_line_reports_this_turns_events():
    stats = {"new_tokens": 5, "decode_tokens_per_s": 10.0, "mean_accepted_length": 2.0,
             "oov_events": [7], "insertions": [30], "evictions": [2], "buffer_occupancy": [28]}
    line = turn_line(stats, {"oov_events": [4], "insertions": [20], "evictions": [0]})
    assert "OOV events 3" in line and "inserted 10" in line and "evicted 2" in line
    assert "buffer 28" in line
