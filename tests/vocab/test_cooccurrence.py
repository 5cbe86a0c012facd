"""EvoSpec's co-occurrence graph: bigram counts, pruning, files, resuming."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from specjax.vocab.cooccurrence import (
    count_bigrams,
    load_graph,
    save_graph,
    successor_table,
)
from specjax.vocab.corpus_counts import tokenizer_fingerprint

DOCS = ["the cat sat on the mat", "the cat ran", "a dog sat on a mat", "the dog ran on the mat",
        "hi", "hello the cat"] * 7


def hand_bigrams(tok, docs):
    vocab = tok.get_vocab()
    c = Counter()
    for d in docs:
        ids = [vocab[w] for w in d.split()]
        c.update(zip(ids[:-1], ids[1:], strict=True))
    return c


def test_counts_match_a_hand_count(tok):
    v = len(tok)
    keys, counts, tokens = count_bigrams(tok, DOCS, vocab_size=v, out_dir=None, corpus="toy",
                                         batch_size=5, progress=False)
    got = {(int(k) // v, int(k) % v): int(n) for k, n in zip(keys, counts, strict=True)}
    assert got == dict(hand_bigrams(tok, DOCS))
    assert tokens == sum(len(d.split()) for d in DOCS)


def test_a_resumed_count_equals_one_run(tok, tmp_path):
    v = len(tok)
    one = count_bigrams(tok, DOCS, vocab_size=v, out_dir=None, corpus="toy", progress=False)
    count_bigrams(tok, DOCS[:10], vocab_size=v, out_dir=tmp_path / "c", corpus="toy",
                  checkpoint_every=3, batch_size=2, progress=False)
    two = count_bigrams(tok, DOCS, vocab_size=v, out_dir=tmp_path / "c", corpus="toy",
                        checkpoint_every=3, batch_size=2, progress=False)
    for a, b in zip(one, two, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="another corpus"):
        count_bigrams(tok, DOCS, vocab_size=v, out_dir=tmp_path / "c", corpus="other",
                      progress=False)


def test_successors_are_pruned_and_ranked():
    v = 6
    pairs = {(0, 1): 50, (0, 2): 30, (0, 3): 4, (0, 4): 30, (1, 2): 10, (2, 5): 5, (3, 4): 1}
    keys = np.asarray([u * v + w for u, w in pairs], np.int64)
    counts = np.asarray(list(pairs.values()), np.int64)
    t = successor_table(keys, counts, v, min_count=5, min_prob=0.0, max_degree=2)
    # 0 -> 1 (p .44), then 2 and 4 tie at .26: the smaller id first, cut at the degree.
    assert t.tolist() == [[1, 2], [2, -1], [5, -1], [-1, -1], [-1, -1], [-1, -1]]
    # p(3 | 0) = 4/114 fails min_count; a min_prob of 0.3 leaves 0 -> 1 only.
    t = successor_table(keys, counts, v, min_count=1, min_prob=0.3, max_degree=4)
    assert t[0].tolist() == [1, -1, -1, -1] and t[3].tolist() == [4, -1, -1, -1]


def test_graph_files_round_trip_and_refuse_mismatches(tok, tmp_path):
    fp = tokenizer_fingerprint(tok)
    table = np.asarray([[1, -1], [0, 2], [-1, -1]], np.int32)
    save_graph(tmp_path / "g", table, {"tokenizer_fingerprint": fp})
    np.testing.assert_array_equal(load_graph(tmp_path / "g", vocab_size=3, fingerprint=fp), table)
    with pytest.raises(ValueError, match="another tokenizer.*build-graph"):
        load_graph(tmp_path / "g", vocab_size=3, fingerprint="0" * 64)
    with pytest.raises(ValueError, match="vocabulary of 3"):
        load_graph(tmp_path / "g", vocab_size=4, fingerprint=fp)
    np.save(tmp_path / "g.npy", table + 1)
    with pytest.raises(ValueError, match="damaged"):
        load_graph(tmp_path / "g")
    with pytest.raises(FileNotFoundError, match="missing"):
        load_graph(tmp_path / "nowhere")


def test_build_graph_command_end_to_end(tok, model_dir, tmp_path, capsys):
    from specjax.cli import main

    txt = tmp_path / "corpus.txt"
    txt.write_text("\n\n".join(DOCS))
    out = tmp_path / "graph" / "g"
    argv = ["build-graph", "--model", str(model_dir), "--corpus", str(txt), "--out", str(out),
            "--min-count", "2", "--min-prob", "0", "--max-degree", "3", "--no-progress"]
    assert main(argv) == 0
    assert "edges over" in capsys.readouterr().out
    keys, counts, _ = count_bigrams(tok, DOCS, vocab_size=32, out_dir=None, corpus="toy",
                                    progress=False)
    expect = successor_table(keys, counts, 32, min_count=2, min_prob=0.0, max_degree=3)
    fp = tokenizer_fingerprint(tok)
    np.testing.assert_array_equal(load_graph(out, vocab_size=32, fingerprint=fp), expect)
    vocab = tok.get_vocab()
    assert vocab["cat"] in load_graph(out)[vocab["the"]]  # "the cat" is the commonest pair
    # A rerun resumes from the finished count and writes the same graph.
    assert main(argv) == 0
    np.testing.assert_array_equal(load_graph(out), expect)
    # Thresholds out of range are refused before anything is read or written.
    bad = tmp_path / "bad" / "g"
    assert main(["build-graph", "--model", str(model_dir), "--corpus", str(txt), "--out",
                 str(bad), "--min-prob", "2", "--no-progress"]) == 2
    assert "--min-prob in [0, 1]" in capsys.readouterr().err and not bad.parent.exists()
