"""Self-distillation data: the target's greedy answers as pre-tokenised, resumable records."""

from __future__ import annotations

import json

import pytest

import specjax
from specjax.train.data import load_examples
from specjax.train.selfdistill import generate_self_distill

PROMPTS = [[5, 17, 42], [7, 3, 3, 9, 11], [100, 2], [64, 65, 66, 67]]


def _run(target, out, **kw):
    return generate_self_distill(target, PROMPTS, out, **({"max_new_tokens": 6, "batch_size": 3,
                                                          "engine": "specjax",
                                                          "progress": False} | kw))


def test_records_are_the_targets_greedy_answers(tiny_target, tmp_path):
    out = tmp_path / "sd.jsonl"
    meta = _run(tiny_target, out)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_index"] for r in recs] == list(range(len(PROMPTS)))
    for p, r in zip(PROMPTS, recs, strict=True):
        want = specjax.generate(tiny_target, [p], max_new_tokens=6).tokens[0]
        assert r["tokens"] == p + want
        assert r["assistant"] == [0] * len(p) + [1] * len(want)
        assert r["finished"] == (want[-1] in tiny_target.eos_ids)
    assert meta["records"] == len(PROMPTS)
    assert meta["answer_tokens"] == sum(sum(r["assistant"]) for r in recs)
    # The records feed the drafter's data reader as they are.
    examples, stats = load_examples(out, tokenizer=None, vocab_size=tiny_target.cfg.vocab_size,
                                    max_len=64, min_tokens=1)
    assert stats.used == len(PROMPTS) and examples[1].assistant.sum() == len(recs[1]["tokens"]) - 5


def test_resume_skips_done_prompts_drops_a_torn_line_and_refuses_other_settings(
        tiny_target, tmp_path):
    full, part = tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    _run(tiny_target, full)
    _run(tiny_target, part)
    lines = part.read_text().splitlines()
    part.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])  # crash mid-write
    meta = _run(tiny_target, part)
    assert part.read_text() == full.read_text()
    assert meta["records"] == len(PROMPTS)
    with pytest.raises(ValueError, match="other settings"):
        _run(tiny_target, part, max_new_tokens=7)
    with pytest.raises(ValueError, match="engine"):
        _run(tiny_target, tmp_path / "x.jsonl", engine="vllm")


def test_sampled_answers_are_the_targets_samples_and_resume_to_the_same_draws(tiny_target,
                                                                              tmp_path):
    full, part = tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    meta = _run(tiny_target, full, temperature=1.0, seed=3)
    assert meta["settings"]["greedy"] is False and meta["settings"]["temperature"] == 1.0
    recs = [json.loads(line) for line in full.read_text().splitlines()]
    # The second batch starts at prompt 3: its key is (seed 3, prompt 3).
    want = specjax.generate(tiny_target, PROMPTS[3:], max_new_tokens=6, temperature=1.0,
                            seed=3 * 1_000_003 + 3).tokens
    assert [r["tokens"][len(p):] for p, r in zip(PROMPTS[3:], recs[3:], strict=True)] == want
    greedy = [json.loads(line) for line in _greedy(tiny_target, tmp_path)]
    assert any(a["tokens"] != b["tokens"] for a, b in zip(recs, greedy, strict=True))
    _run(tiny_target, part, temperature=1.0, seed=3)
    lines = part.read_text().splitlines()
    part.write_text("\n".join(lines[:3]) + "\n" + lines[3][:5])  # crash mid-second batch
    _run(tiny_target, part, temperature=1.0, seed=3)
    assert part.read_text() == full.read_text()
    with pytest.raises(ValueError, match="other settings"):
        _run(tiny_target, part, temperature=1.0, seed=4)
    with pytest.raises(ValueError, match="temperature"):
        _run(tiny_target, tmp_path / "neg.jsonl", temperature=-1.0)


def _greedy(target, tmp_path):
    out = tmp_path / "greedy.jsonl"
    _run(target, out)
    return out.read_text().splitlines()


def test_the_transformers_engine_answers_as_specjax_does(tiny_target, tmp_path):
    """The default engine (transformers' batched generate, left-padded) and specjax's give
    the same greedy records, on prompts of different lengths in one batch."""
    pytest.importorskip("torch")
    ours = _run(tiny_target, tmp_path / "specjax.jsonl", max_new_tokens=8)
    theirs = _run(tiny_target, tmp_path / "hf.jsonl", max_new_tokens=8, engine="transformers")
    assert theirs["answer_tokens"] == ours["answer_tokens"]
    for a, b in zip((tmp_path / "specjax.jsonl").read_text().splitlines(),
                    (tmp_path / "hf.jsonl").read_text().splitlines(), strict=True):
        a, b = json.loads(a), json.loads(b)
        assert (a["tokens"], a["assistant"], a["finished"]) == (
            b["tokens"], b["assistant"], b["finished"])


@pytest.fixture(scope="module")
def word_target_dir(tmp_path_factory):
    """Self-distillation reads text prompts."""
    from tests.tiny import make_word_target

    return make_word_target(tmp_path_factory.mktemp("sd_cli"))


def test_the_self_distill_command_answers_first_user_turns(word_target_dir, tmp_path, capsys):
    from specjax.cli import main
    from specjax.train.prompts import encode_user_turn

    turns = ["the cat sat on a mat", "hello", "a dog ran"]
    src = tmp_path / "sharegpt.json"
    src.write_text(json.dumps([{"conversations": [{"from": "human", "value": t},
                                                  {"from": "gpt", "value": "hi"}]}
                               for t in turns]))
    out = tmp_path / "sd.jsonl"
    common = ["train", "self-distill", "--target", str(word_target_dir), "--prompts", str(src),
              "--max-new-tokens", "3", "--batch-size", "2", "--engine", "specjax",
              "--no-progress"]
    assert main([*common, "--out", str(out), "--skip", "1", "--num-prompts", "5"]) == 0
    assert json.loads(capsys.readouterr().out)["records"] == 2
    target = specjax.load(word_target_dir)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    for turn, rec in zip(turns[1:], recs, strict=True):  # --skip 1 passes over the first
        prompt = list(encode_user_turn(target.tokenizer, turn))
        answer = specjax.generate(target, [prompt], max_new_tokens=3).tokens[0]
        assert rec["tokens"] == prompt + answer
        assert rec["assistant"] == [0] * len(prompt) + [1] * len(answer)

    # Refusals, each before any answer is written.
    for flags, message in [
        (["--mix", "default", "--self-prompts", str(out)], "two prompt sources; choose one"),
        (["--mix", "chat:1"], "expected 'default' or KIND=WEIGHT pairs"),
        (["--skip", "3"], "no usable prompts after 3 records"),
        (["--prompts", "sharegpt", "--mix", "chat=1", "--skip", "10000000"],
         "calibration prompts, never training data"),
    ]:
        bad = tmp_path / "bad.jsonl"
        assert main([*common, "--out", str(bad), *flags]) == 2
        assert message in capsys.readouterr().err and not bad.exists()
