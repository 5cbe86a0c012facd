"""FR-Spec token counting: counts, corpora, resuming, counts files, the build-shortlist CLI."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from specjax.vocab import corpus_counts
from specjax.vocab.build_shortlist import add_parser, main, run_build_shortlist
from specjax.vocab.corpus_counts import (
    TokenCounts,
    count_tokens,
    iter_corpus,
    load_counts,
    read_progress,
    required_tokens,
    save_counts,
    tokenizer_fingerprint,
)
from specjax.vocab.shortlist import build_shortlist, load_shortlist
from tests.vocab.conftest import TEMPLATE, WORDS, hand_count, toy_docs, toy_tokenizer

DOCS = ["the cat sat on the mat", "a dog ran", "the the zebra", "",
        "<|im_start|>user\nhi<|im_end|>\n"]


def test_count_matches_hand_count(tok):
    v = len(tok)
    got = count_tokens(tok, DOCS, out_dir=None, corpus="t", batch_size=2, progress=False)
    np.testing.assert_array_equal(got, hand_count(tok, DOCS, v))
    assert got[tok.convert_tokens_to_ids("the")] == 4 and got[0] == 1  # "zebra" is [UNK]
    padded = count_tokens(tok, DOCS, out_dir=None, corpus="t", vocab_size=v + 6, progress=False)
    assert padded.shape == (v + 6,) and not padded[v:].any()
    np.testing.assert_array_equal(padded[:v], got)
    # A smaller model vocabulary is fine only when nothing beyond it was counted.
    assert count_tokens(tok, ["the"], out_dir=None, corpus="t", vocab_size=v - 1,
                        progress=False).shape == (v - 1,)
    with pytest.raises(ValueError, match="ids >= vocab_size"):
        count_tokens(tok, ["hello"], out_dir=None, corpus="t", vocab_size=v - 1, progress=False)


def test_corpus_readers(tok, tmp_path):
    txt = tmp_path / "c.txt"
    txt.write_text("the cat\nsat on\n\n\nthe mat\n  \na dog\n")
    assert list(iter_corpus(txt, None)) == ["the cat\nsat on", "the mat", "a dog"]
    conv = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    jl = tmp_path / "c.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in [
        {"text": "a dog ran"}, {"conversations": conv},
        {"messages": [{"role": "user", "content": "hi"}]},  # no assistant turn: skipped
        {"other": 1}]) + "\n")
    stats = corpus_counts.ReadStats()
    docs = list(iter_corpus(jl, tok, stats))
    assert docs == ["a dog ran", tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        tokenize=False)]
    assert stats.records == 4 and stats.used == 2 and sum(stats.skipped.values()) == 2
    with pytest.raises(ValueError, match="chat template"):
        list(iter_corpus(jl, None))
    with pytest.raises(ValueError, match="unsupported suffix"):
        (tmp_path / "c.csv").write_text("x")
        iter_corpus(tmp_path / "c.csv", tok)
    # The description changes with the file's content and with the chat template.
    d1 = corpus_counts.corpus_description(jl, tok)
    jl.write_text(jl.read_text() + "\n")
    assert corpus_counts.corpus_description(jl, tok) != d1
    other = toy_tokenizer()
    other.chat_template = TEMPLATE.replace("\n", " ")
    assert corpus_counts.corpus_description(jl, other) != corpus_counts.corpus_description(jl, tok)


def test_resume_after_interruption_equals_one_run(tok, tmp_path):
    kw = dict(corpus="synthetic", batch_size=3, checkpoint_every=5, progress=False)
    whole = count_tokens(tok, toy_docs(), out_dir=tmp_path / "one", **kw)
    np.testing.assert_array_equal(whole, hand_count(tok, list(toy_docs()), len(tok)))
    with pytest.raises(RuntimeError, match="interrupted"):
        count_tokens(tok, toy_docs(fail_after=23), out_dir=tmp_path / "two", **kw)
    saved = read_progress(tmp_path / "two")
    assert 5 <= saved["docs"] <= 23 and saved["tokenizer_fingerprint"] == tokenizer_fingerprint(tok)
    partial = np.load(tmp_path / "two" / "counts.npy")
    assert partial.sum() == saved["tokens"] < whole.sum()
    resumed = count_tokens(tok, toy_docs(), out_dir=tmp_path / "two", **kw)
    np.testing.assert_array_equal(resumed, whole)
    assert read_progress(tmp_path / "two")["docs"] == 50
    # Nothing new: the same counts; a longer stream extends them; a shorter one is refused.
    np.testing.assert_array_equal(count_tokens(tok, toy_docs(), out_dir=tmp_path / "two", **kw),
                                  whole)
    longer = count_tokens(tok, toy_docs(60), out_dir=tmp_path / "two", **kw)
    np.testing.assert_array_equal(longer, hand_count(tok, list(toy_docs(60)), len(tok)))
    with pytest.raises(ValueError, match="only 40"):
        count_tokens(tok, toy_docs(40), out_dir=tmp_path / "two", **kw)


def test_resume_refuses_other_tokenizer_or_corpus(tok, tmp_path):
    kw = dict(batch_size=4, checkpoint_every=2, progress=False)
    count_tokens(tok, toy_docs(10), out_dir=tmp_path, corpus="synthetic", **kw)
    other = toy_tokenizer(list(reversed(WORDS)))  # same tokens, other ids
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tok)
    with pytest.raises(ValueError, match="another tokenizer"):
        count_tokens(other, toy_docs(10), out_dir=tmp_path, corpus="synthetic", **kw)
    with pytest.raises(ValueError, match="another corpus"):
        count_tokens(tok, toy_docs(10), out_dir=tmp_path, corpus="other", **kw)


def test_kill_mid_checkpoint_recovers_pending_counts(tok, tmp_path, monkeypatch):
    kw = dict(corpus="synthetic", batch_size=2, checkpoint_every=4, progress=False)
    whole = count_tokens(tok, toy_docs(20), out_dir=None, **kw)
    count_tokens(tok, toy_docs(8), out_dir=tmp_path, **kw)
    real_replace = corpus_counts.os.replace

    def killed(src, dst):  # dies after progress.json names the new counts, before the rename
        if str(dst).endswith(corpus_counts.COUNTS_FILE):
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(corpus_counts.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        count_tokens(tok, toy_docs(20), out_dir=tmp_path, **kw)
    monkeypatch.setattr(corpus_counts.os, "replace", real_replace)
    assert read_progress(tmp_path)["docs"] == 12  # the first checkpoint of the second run
    np.testing.assert_array_equal(count_tokens(tok, toy_docs(20), out_dir=tmp_path, **kw), whole)
    # Counts edited behind progress.json's back are refused, not trusted.
    np.save(tmp_path / "counts.npy", whole + 1)
    with pytest.raises(ValueError, match="does not match"):
        count_tokens(tok, toy_docs(20), out_dir=tmp_path, **kw)


def test_required_tokens_are_eos_and_template_specials(tok):
    # <|im_end|> is the tokenizer's EOS and a template token; <tool> and [UNK] are unused.
    assert required_tokens(tok, [1]) == [1, 2, 3]
    assert required_tokens(tok, []) == [2, 3]


def test_counts_round_trip(tok, tmp_path):
    counts = hand_count(tok, list(toy_docs()), len(tok))
    save_counts(tmp_path / "freq_counts", TokenCounts(counts, tokenizer_fingerprint(tok), "s",
                                                      {"docs": 50}))
    tc = load_counts(tmp_path / "freq_counts.json", vocab_size=len(tok),
                     fingerprint=tokenizer_fingerprint(tok))
    np.testing.assert_array_equal(tc.counts, counts)
    assert tc.meta["docs"] == 50 and tc.meta["tokens"] == counts.sum() and tc.source == "s"
    with pytest.raises(ValueError, match="another tokenizer"):
        load_counts(tmp_path / "freq_counts", fingerprint="0" * 64)


def _cli(*argv):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return run_build_shortlist(parser.parse_args(["build-shortlist", *argv]))


def test_cli_counts_and_writes_shortlists(tok, model_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(model_dir)) == \
        tokenizer_fingerprint(tok)  # the fingerprint survives save/load
    txt, jl = tmp_path / "a.txt", tmp_path / "b.jsonl"
    txt.write_text("\n\n".join(toy_docs(30)))
    jl.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"},
                                                {"from": "gpt", "value": "hello dog"}]}) + "\n")
    out = tmp_path / "out"
    args = ["--model", str(model_dir), "--corpus", str(txt), "--corpus", str(jl), "--sizes",
            "8,4", "--out", str(out), "--export-json", "--no-progress", "--checkpoint-every", "7"]
    assert main(["build-shortlist", *args]) == 0  # main() records its command line
    summary = json.loads(capsys.readouterr().out)
    assert summary["docs"] == 31 and set(summary["shortlists"]) == {"4", "8"}
    fp = tokenizer_fingerprint(tok)
    docs = list(toy_docs(30)) + list(iter_corpus(jl, tok))
    expect = hand_count(tok, docs, 32)
    tc = load_counts(out / "freq_counts", vocab_size=32, fingerprint=fp)
    np.testing.assert_array_equal(tc.counts, expect)
    assert tc.meta["docs"] == 31 and tc.meta["docs_per_corpus"] == {str(txt): 30, str(jl): 1}
    assert tc.meta["command"].startswith("python -m specjax.vocab.build_shortlist build-shortlist")
    assert "--sizes 8,4" in tc.meta["command"]
    for n in (4, 8):
        sl = load_shortlist(out / f"fr_{n}", vocab_size=32, fingerprint=fp, eos_ids=[1, 3])
        assert sl.size == n and {1, 2, 3} <= set(sl.ids.tolist())
        assert json.loads((out / f"fr_{n}.ids.json").read_text()) == sl.ids.tolist()
    assert load_shortlist(out / "fr_8", vocab_size=32).ids.tolist()[:5] == \
        build_shortlist(expect, 8, [1, 2, 3]).ids.tolist()[:5]
    # A rerun (through the parser, as specjax/cli.py wires it) resumes with nothing left.
    assert _cli(*args) == 0
    np.testing.assert_array_equal(load_counts(out / "freq_counts").counts, expect)
    # Too large a size is refused before counting; main() turns it into exit code 2.
    assert main(["build-shortlist", "--model", str(model_dir), "--corpus", str(txt), "--sizes",
                 "64", "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    assert "each size must lie in [3, 32]" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_cli_import_swaps_in_required(model_dir, tmp_path, capsys):
    (tmp_path / "freq_6.json").write_text("[9, 8, 7, 6, 5, 4]")  # lacks EOS and the specials
    out = tmp_path / "out"
    assert _cli("--model", str(model_dir), "--import", str(tmp_path / "freq_6.json"), "--out",
                str(out), "--no-progress") == 0
    assert json.loads(capsys.readouterr().out)["required_swapped_in"] == [1, 2, 3]
    sl = load_shortlist(out / "fr_6", vocab_size=32, eos_ids=[1, 3])
    assert sl.ids.tolist() == [9, 8, 7, 1, 2, 3] and sl.tokenizer_fingerprint is None


def test_fingerprint_is_remembered_until_tokens_are_added(monkeypatch):
    """Each generate call that resolves a shortlist checks the fingerprint: it is hashed
    once per tokenizer, and again after the tokenizer grows."""
    tok = toy_tokenizer()
    calls = []
    real = corpus_counts._fingerprint
    monkeypatch.setattr(corpus_counts, "_fingerprint", lambda t: calls.append(1) or real(t))
    fp = tokenizer_fingerprint(tok)
    assert tokenizer_fingerprint(tok) == fp and len(calls) == 1
    assert tokenizer_fingerprint(toy_tokenizer()) == fp and len(calls) == 2  # another object
    tok.add_tokens(["platypus"])
    grown = tokenizer_fingerprint(tok)
    assert grown != fp and len(calls) == 3
    assert tokenizer_fingerprint(tok) == grown and len(calls) == 3
