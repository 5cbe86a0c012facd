"""FR-Spec shortlists: ranking, required tokens, shortlist files, import/export."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specjax.vocab.corpus_counts import required_tokens, tokenizer_fingerprint
from specjax.vocab.shortlist import (
    Shortlist,
    build_shortlist,
    export_token_list,
    import_token_list,
    load_shortlist,
    save_shortlist,
    with_required,
)
from tests.vocab.conftest import hand_count, toy_docs


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
    counts = hand_count(tok, list(toy_docs()), len(tok))
    return build_shortlist(counts, n, required_tokens(tok, []),
                           tokenizer_fingerprint=tokenizer_fingerprint(tok), source="synthetic")


def test_shortlist_round_trip(tok, tmp_path):
    sl = _shortlist(tok)
    path = save_shortlist(tmp_path / "fr_6", sl, {"coverage": 0.5})
    assert path.name == "fr_6.npy" and json.loads((tmp_path / "fr_6.json").read_text())[
        "coverage"] == 0.5
    back = load_shortlist(tmp_path / "fr_6.npy", vocab_size=len(tok),
                          fingerprint=tokenizer_fingerprint(tok), eos_ids=[3])
    np.testing.assert_array_equal(back.ids, sl.ids)
    assert (back.vocab_size, back.tokenizer_fingerprint, back.source) == (
        sl.vocab_size, sl.tokenizer_fingerprint, sl.source)


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


@pytest.mark.parametrize("name, content, message", [
    ("missing.json", None, "no such token-list file"),
    ("list.txt", b"1 2 3", "unsupported token-list suffix '.txt'"),
    ("bad.json", b"[1, 2,", "not JSON"),
    ("dict.json", b'{"ids": [1, 2]}', "expected a list of token ids or a 1-D integer tensor"),
    ("bools.json", b"[true, false]", "list of integer token ids"),
    ("empty.json", b"[]", "non-empty 1-D list of token ids"),
    ("twice.json", b"[3, 1, 3]", r"duplicate token ids \[3\].*fix the file, or build"),
    ("negative.json", b"[3, -1]", "outside the vocabulary"),
    ("floats.npy", "floats", "must be integers"),
    ("grid.npy", "grid", "non-empty 1-D"),
    ("objects.npy", "objects", "not a plain numpy array"),
    ("legacy.pt", b"\x80\x02}q\x00.", "not a zip-format torch file"),
])
def test_import_refuses_what_is_not_a_token_list(tmp_path, name, content, message):
    path = tmp_path / name
    if content == "floats":
        np.save(path, np.array([1.0, 2.0]))
    elif content == "grid":
        np.save(path, np.arange(6).reshape(2, 3))
    elif content == "objects":
        np.save(path, np.array([1, "a"], object), allow_pickle=True)
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        import_token_list(path, vocab_size=8)
