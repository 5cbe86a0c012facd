"""FR-Spec frequency lists: counting, resuming, shortlists, files, import/export, CLI."""

from __future__ import annotations

import argparse
import json
from collections import Counter

import numpy as np
import pytest

from specjax.vocab import freq
from specjax.vocab.freq import (
    Shortlist,
    TokenCounts,
    build_shortlist,
    count_tokens,
    export_token_list,
    import_token_list,
    iter_corpus,
    load_counts,
    load_shortlist,
    read_progress,
    required_tokens,
    save_counts,
    save_shortlist,
    tokenizer_fingerprint,
    with_required,
)
from specjax.vocab.freq_cli import add_build_shortlist_parser, main, run_build_shortlist

SPECIALS = ["[UNK]", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>"]
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "user", "assistant", "system",
         "hi", "hello"]
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
            "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\n' }}{% endif %}")


def _tokenizer(words=WORDS):
    """A word-level fast tokenizer (whitespace split) with ChatML specials; 18 ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS[1:])
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=TEMPLATE,
                                   unk_token="[UNK]", eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


def _hand_count(tok, docs, v):
    """Whitespace words (and the specials, which never touch a word) -> ids; unknown -> 0."""
    vocab = tok.get_vocab()
    c = Counter()
    for d in docs:
        for s in SPECIALS[1:]:
            d = d.replace(s, f" {s} ")
        c.update(vocab.get(w, 0) for w in d.split())
    out = np.zeros(v, np.int64)
    for i, n in c.items():
        out[i] = n
    return out


DOCS = ["the cat sat on the mat", "a dog ran", "the the zebra", "",
        "<|im_start|>user\nhi<|im_end|>\n"]


def test_count_matches_hand_count(tok):
    v = len(tok)
    got = count_tokens(tok, DOCS, out_dir=None, corpus="t", batch_size=2, progress=False)
    np.testing.assert_array_equal(got, _hand_count(tok, DOCS, v))
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
    stats = freq.ReadStats()
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
    d1 = freq.corpus_description(jl, tok)
    jl.write_text(jl.read_text() + "\n")
    assert freq.corpus_description(jl, tok) != d1
    other = _tokenizer()
    other.chat_template = TEMPLATE.replace("\n", " ")
    assert freq.corpus_description(jl, other) != freq.corpus_description(jl, tok)


def _docs(n=50, fail_after=None):
    words = WORDS[:8] + ["zebra"]
    for i in range(n):
        if fail_after is not None and i == fail_after:
            raise RuntimeError("interrupted")
        yield " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(i % 6 + 1))


def test_resume_after_interruption_equals_one_run(tok, tmp_path):
    kw = dict(corpus="synthetic", batch_size=3, checkpoint_every=5, progress=False)
    whole = count_tokens(tok, _docs(), out_dir=tmp_path / "one", **kw)
    np.testing.assert_array_equal(whole, _hand_count(tok, list(_docs()), len(tok)))
    with pytest.raises(RuntimeError, match="interrupted"):
        count_tokens(tok, _docs(fail_after=23), out_dir=tmp_path / "two", **kw)
    saved = read_progress(tmp_path / "two")
    assert 5 <= saved["docs"] <= 23 and saved["tokenizer_fingerprint"] == tokenizer_fingerprint(tok)
    partial = np.load(tmp_path / "two" / "counts.npy")
    assert partial.sum() == saved["tokens"] < whole.sum()
    resumed = count_tokens(tok, _docs(), out_dir=tmp_path / "two", **kw)
    np.testing.assert_array_equal(resumed, whole)
    assert read_progress(tmp_path / "two")["docs"] == 50
    # Nothing new: the same counts; a longer stream extends them; a shorter one is refused.
    np.testing.assert_array_equal(count_tokens(tok, _docs(), out_dir=tmp_path / "two", **kw),
                                  whole)
    longer = count_tokens(tok, _docs(60), out_dir=tmp_path / "two", **kw)
    np.testing.assert_array_equal(longer, _hand_count(tok, list(_docs(60)), len(tok)))
    with pytest.raises(ValueError, match="only 40"):
        count_tokens(tok, _docs(40), out_dir=tmp_path / "two", **kw)


def test_resume_refuses_other_tokenizer_or_corpus(tok, tmp_path):
    kw = dict(batch_size=4, checkpoint_every=2, progress=False)
    count_tokens(tok, _docs(10), out_dir=tmp_path, corpus="synthetic", **kw)
    other = _tokenizer(list(reversed(WORDS)))  # same tokens, other ids
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tok)
    with pytest.raises(ValueError, match="another tokenizer"):
        count_tokens(other, _docs(10), out_dir=tmp_path, corpus="synthetic", **kw)
    with pytest.raises(ValueError, match="another corpus"):
        count_tokens(tok, _docs(10), out_dir=tmp_path, corpus="other", **kw)


def test_kill_mid_checkpoint_recovers_pending_counts(tok, tmp_path, monkeypatch):
    kw = dict(corpus="synthetic", batch_size=2, checkpoint_every=4, progress=False)
    whole = count_tokens(tok, _docs(20), out_dir=None, **kw)
    count_tokens(tok, _docs(8), out_dir=tmp_path, **kw)
    real_replace = freq.os.replace

    def killed(src, dst):  # dies after progress.json names the new counts, before the rename
        if str(dst).endswith(freq.COUNTS_FILE):
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(freq.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        count_tokens(tok, _docs(20), out_dir=tmp_path, **kw)
    monkeypatch.setattr(freq.os, "replace", real_replace)
    assert read_progress(tmp_path)["docs"] == 12  # the first checkpoint of the second run
    np.testing.assert_array_equal(count_tokens(tok, _docs(20), out_dir=tmp_path, **kw), whole)
    # Counts edited behind progress.json's back are refused, not trusted.
    np.save(tmp_path / "counts.npy", whole + 1)
    with pytest.raises(ValueError, match="does not match"):
        count_tokens(tok, _docs(20), out_dir=tmp_path, **kw)


def test_required_tokens_are_eos_and_template_specials(tok):
    # <|im_end|> is the tokenizer's EOS and a template token; <tool> and [UNK] are unused.
    assert required_tokens(tok, [1]) == [1, 2, 3]
    assert required_tokens(tok, []) == [2, 3]


def test_build_shortlist_ranks_and_keeps_required():
    counts = np.array([5, 9, 9, 0, 3, 7])
    sl = build_shortlist(counts, 3, source="s")
    assert sl.ids.tolist() == [1, 2, 5] and sl.ids.dtype == np.int32 and sl.vocab_size == 6
    # A missing required id replaces the least frequent entry; order stays by count.
    assert build_shortlist(counts, 3, [3]).ids.tolist() == [1, 2, 3]
    assert build_shortlist(counts, 3, [0, 3]).ids.tolist() == [1, 0, 3]
    assert build_shortlist(counts, 3, [2]).ids.tolist() == [1, 2, 5]  # already in
    assert build_shortlist(counts, 6).ids.tolist() == [1, 2, 5, 0, 4, 3]
    with pytest.raises(ValueError, match="required tokens"):
        build_shortlist(counts, 1, [0, 3])
    with pytest.raises(ValueError, match="at most the vocabulary"):
        build_shortlist(counts, 7)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        build_shortlist(counts, 3, [6])
    with pytest.raises(ValueError, match="duplicate"):
        Shortlist(np.array([1, 1]), 6, None, "")
    imported = Shortlist(np.array([4, 5, 0, 1]), 6, None, "x")
    assert with_required(imported, [3, 4]).ids.tolist() == [4, 5, 0, 3]


def _shortlist(tok, n=6):
    counts = _hand_count(tok, list(_docs()), len(tok))
    return build_shortlist(counts, n, required_tokens(tok, []),
                           tokenizer_fingerprint=tokenizer_fingerprint(tok), source="synthetic")


def test_shortlist_and_counts_round_trip(tok, tmp_path):
    sl = _shortlist(tok)
    path = save_shortlist(tmp_path / "fr_6", sl, {"coverage": 0.5})
    assert path.name == "fr_6.npy" and json.loads((tmp_path / "fr_6.json").read_text())[
        "coverage"] == 0.5
    back = load_shortlist(tmp_path / "fr_6.npy", vocab_size=len(tok),
                          fingerprint=tokenizer_fingerprint(tok), eos_ids=[3])
    np.testing.assert_array_equal(back.ids, sl.ids)
    assert (back.vocab_size, back.tokenizer_fingerprint, back.source) == (
        sl.vocab_size, sl.tokenizer_fingerprint, sl.source)
    counts = _hand_count(tok, list(_docs()), len(tok))
    save_counts(tmp_path / "freq_counts", TokenCounts(counts, tokenizer_fingerprint(tok), "s",
                                                      {"docs": 50}))
    tc = load_counts(tmp_path / "freq_counts.json", vocab_size=len(tok),
                     fingerprint=tokenizer_fingerprint(tok))
    np.testing.assert_array_equal(tc.counts, counts)
    assert tc.meta["docs"] == 50 and tc.meta["tokens"] == counts.sum() and tc.source == "s"
    with pytest.raises(ValueError, match="another tokenizer"):
        load_counts(tmp_path / "freq_counts", fingerprint="0" * 64)


def test_load_shortlist_refusals(tok, tmp_path):
    sl = _shortlist(tok)
    fp, v = tokenizer_fingerprint(tok), len(tok)
    save_shortlist(tmp_path / "fr", sl)
    with pytest.raises(ValueError, match="built with another tokenizer"):
        load_shortlist(tmp_path / "fr", vocab_size=v, fingerprint="f" * 64)
    with pytest.raises(ValueError, match="vocabulary of 18 ids but the model has 32"):
        load_shortlist(tmp_path / "fr", vocab_size=32)
    no_eos = build_shortlist(np.arange(v), 6, [2], tokenizer_fingerprint=fp)
    save_shortlist(tmp_path / "noeos", no_eos)
    with pytest.raises(ValueError, match="omits EOS id 3.*specjax build-shortlist"):
        load_shortlist(tmp_path / "noeos", vocab_size=v, fingerprint=fp, eos_ids=[3])
    for name, ids, msg in [("range", [1, 2, 99], "outside the vocabulary"),
                           ("dup", [1, 2, 2], "duplicate token ids \\[2\\]")]:
        save_shortlist(tmp_path / name, sl)
        np.save(tmp_path / f"{name}.npy", np.array(ids, np.int32))
        with pytest.raises(ValueError, match=msg):
            load_shortlist(tmp_path / name, vocab_size=v)
    np.save(tmp_path / "fr.npy", sl.ids[::-1])  # valid ids, but not the ones the sidecar hashed
    with pytest.raises(ValueError, match="does not match its sidecar"):
        load_shortlist(tmp_path / "fr", vocab_size=v)
    (tmp_path / "fr.json").unlink()
    with pytest.raises(FileNotFoundError, match="fr.json is missing"):
        load_shortlist(tmp_path / "fr", vocab_size=v)
    # An imported list has no fingerprint: accepted with any tokenizer.
    save_shortlist(tmp_path / "imp", Shortlist(sl.ids, v, None, "imported"))
    assert load_shortlist(tmp_path / "imp", vocab_size=v, fingerprint=fp).tokenizer_fingerprint \
        is None


def test_import_torch_files_without_torch(tmp_path):
    torch = pytest.importorskip("torch")
    ids = [17, 3, 250, 0, 42]
    torch.save(ids, tmp_path / "freq_5.pt")  # FR-Spec: a list of ints
    torch.save(torch.tensor(ids, dtype=torch.long), tmp_path / "map.pt")  # SGLang token map
    torch.save(torch.arange(20)[1:11:2], tmp_path / "view.pt")  # offset + stride
    torch.save(torch.tensor(ids, dtype=torch.int32), tmp_path / "i32.pth")
    torch.save(list(torch.tensor(ids)), tmp_path / "scalars.pt")
    for name in ("freq_5.pt", "map.pt", "i32.pth", "scalars.pt"):
        sl = import_token_list(tmp_path / name, vocab_size=256)
        assert sl.ids.tolist() == ids and sl.tokenizer_fingerprint is None, name
        assert sl.source == f"imported from {name}"
    assert import_token_list(tmp_path / "view.pt", vocab_size=256).ids.tolist() == [1, 3, 5, 7, 9]
    torch.save(torch.tensor([1.0, 2.0]), tmp_path / "float.pt")
    with pytest.raises(ValueError, match="must be integers"):
        import_token_list(tmp_path / "float.pt", vocab_size=256)
    torch.save({"w": torch.nn.Linear(2, 2)}, tmp_path / "module.pt")
    with pytest.raises(ValueError, match="unsupported object"):
        import_token_list(tmp_path / "module.pt", vocab_size=256)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        import_token_list(tmp_path / "map.pt", vocab_size=100)


def test_import_export_npy_json(tmp_path):
    np.save(tmp_path / "a.npy", np.array([5, 1, 2], np.int64))
    (tmp_path / "b.json").write_text("[5, 1, 2]")
    for name in ("a.npy", "b.json"):
        assert import_token_list(tmp_path / name, vocab_size=8).ids.tolist() == [5, 1, 2]
    (tmp_path / "c.json").write_text('[5, 1, "x"]')
    with pytest.raises(ValueError, match="list of integer token ids"):
        import_token_list(tmp_path / "c.json", vocab_size=8)
    sl = Shortlist(np.array([7, 0, 3]), 8, "f" * 64, "s")
    save_shortlist(tmp_path / "ours", sl)
    with pytest.raises(ValueError, match="load_shortlist"):
        import_token_list(tmp_path / "ours.json", vocab_size=8)
    for name in ("e.npy", "e.json"):
        export_token_list(sl, tmp_path / name)
        assert import_token_list(tmp_path / name, vocab_size=8).ids.tolist() == [7, 0, 3]
    assert json.loads((tmp_path / "e.json").read_text()) == [7, 0, 3]
    with pytest.raises(ValueError, match="export to .npy or .json"):
        export_token_list(sl, tmp_path / "e.pt")


@pytest.fixture(scope="module")
def model_dir(tok, tmp_path_factory):
    """A converted-target stand-in: a manifest (no tensors are read) and tokenizer files."""
    from specjax.checkpoint import FORMAT, MANIFEST, VERSION
    from specjax.config import ModelConfig

    d = tmp_path_factory.mktemp("model")
    cfg = ModelConfig(model_type="llama", vocab_size=32, hidden_size=8, intermediate_size=8,
                      num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5,
                      rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=True,
                      eos_token_ids=(1,))
    (d / MANIFEST).write_text(json.dumps({"format": FORMAT, "version": VERSION,
                                          "config": cfg.to_json()}))
    tok.save_pretrained(d)
    return d


def _cli(*argv):
    parser = argparse.ArgumentParser()
    add_build_shortlist_parser(parser.add_subparsers(dest="command"))
    return run_build_shortlist(parser.parse_args(["build-shortlist", *argv]))


def test_cli_counts_and_writes_shortlists(tok, model_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(model_dir)) == \
        tokenizer_fingerprint(tok)  # the fingerprint survives save/load
    txt, jl = tmp_path / "a.txt", tmp_path / "b.jsonl"
    txt.write_text("\n\n".join(_docs(30)))
    jl.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"},
                                                {"from": "gpt", "value": "hello dog"}]}) + "\n")
    out = tmp_path / "out"
    args = ["--model", str(model_dir), "--corpus", str(txt), "--corpus", str(jl), "--sizes",
            "8,4", "--out", str(out), "--export-json", "--no-progress", "--checkpoint-every", "7"]
    assert main(["build-shortlist", *args]) == 0  # main() records its command line
    summary = json.loads(capsys.readouterr().out)
    assert summary["docs"] == 31 and set(summary["shortlists"]) == {"4", "8"}
    fp = tokenizer_fingerprint(tok)
    docs = list(_docs(30)) + list(iter_corpus(jl, tok))
    expect = _hand_count(tok, docs, 32)
    tc = load_counts(out / "freq_counts", vocab_size=32, fingerprint=fp)
    np.testing.assert_array_equal(tc.counts, expect)
    assert tc.meta["docs"] == 31 and tc.meta["docs_per_corpus"] == {str(txt): 30, str(jl): 1}
    assert tc.meta["command"].startswith("python -m specjax.vocab.freq_cli build-shortlist")
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
