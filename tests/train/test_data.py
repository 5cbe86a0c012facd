"""Drafter training data (:mod:`specjax.train.data`): reading and rendering conversations,
the hidden-state cache (resumable, saved on a thread), the target's fingerprint."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.model import forward_hidden, init_cache
from specjax.train.data import (
    ReadStats,
    cache_hidden_states,
    iter_json_array,
    load_examples,
    load_split,
    normalize_messages,
    row_loss_mask,
    target_fingerprint,
)
from tests.train.tiny_data import char_tokenizer, sequences


def _direct_hidden(target, tokens: np.ndarray) -> np.ndarray:
    """forward_hidden on one unpadded sequence (jitted: eager dispatch is slow)."""
    t = len(tokens)
    fwd = jax.jit(forward_hidden, static_argnames="cfg")
    h, _, _ = fwd(target.params, target.cfg, jnp.asarray(tokens)[None], jnp.arange(t)[None],
                  init_cache(target.cfg, 1, t))
    return np.asarray(h[0])


def test_cached_hidden_states_equal_direct_forward(target, cache):
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["complete"] and manifest["splits"]["heldout"]["examples"] == 5
    examples = sequences()
    for split in ("train", "heldout"):
        s = load_split(cache, split)
        assert len(s) == manifest["splits"][split]["examples"]
        for i in range(len(s)):
            ex = examples[int(s.index[i])]
            o, n = int(s.offsets[i]), int(s.lengths[i])
            np.testing.assert_array_equal(s.tokens[o:o + n], ex.tokens)
            np.testing.assert_array_equal(s.assistant[o:o + n], ex.assistant)
            # One unpadded forward per sequence compiles per length: check a few of each split.
            if i < 3:
                np.testing.assert_allclose(s.hidden[o:o + n], _direct_hidden(target, ex.tokens),
                                           atol=2e-5, rtol=2e-5)
    # The first 20% of the examples, in order, are the held-out ones.
    assert sorted(load_split(cache, "heldout").index.tolist()) == list(range(5))


def test_cache_resumes_missing_shards_and_refuses_other_data(target, tmp_path):
    ex = sequences(10)
    kw = dict(heldout_fraction=0.1, token_budget=64, batches_per_shard=1, progress=False)
    cache_hidden_states(target.cfg, target.params, ex, tmp_path, **kw)
    shard = tmp_path / "train" / "shard_00001.npz"
    before = dict(np.load(shard))
    shard.unlink()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["complete"] = False  # as if interrupted
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    others = {p: p.stat().st_mtime_ns for p in (tmp_path / "train").glob("*.npz")}
    cache_hidden_states(target.cfg, target.params, ex, tmp_path, **kw)
    after = dict(np.load(shard))
    assert before.keys() == after.keys()
    for k in before:  # fp16 by default; the recomputed shard is identical
        np.testing.assert_array_equal(before[k], after[k])
    assert {p: p.stat().st_mtime_ns for p in others} == others  # the rest was not rewritten
    with pytest.raises(ValueError, match="other data"):
        cache_hidden_states(target.cfg, target.params, sequences(10, seed=1), tmp_path, **kw)


def test_cache_saves_on_a_thread_report_their_errors_and_resume(target, tmp_path,
                                                                 monkeypatch):
    """Shards are saved on a thread while the next forwards run: a failed save stops the
    call with its own error, leaves the cache incomplete with the shards saved before it,
    and a rerun computes only the rest. A call that computed shards says where its time
    went; one that found the cache complete has nothing to report."""
    from specjax.train import data as data_mod

    ex = sequences(10)
    kw = dict(heldout_fraction=0.1, token_budget=64, batches_per_shard=1, progress=False)
    real, saved = data_mod.atomic_savez, []

    def fail_third(path, **arrays):
        if len(saved) == 2:
            raise OSError(28, "No space left on device")
        real(path, **arrays)
        saved.append(path)

    monkeypatch.setattr(data_mod, "atomic_savez", fail_third)
    with pytest.raises(OSError, match="No space left"):
        cache_hidden_states(target.cfg, target.params, ex, tmp_path, **kw)
    assert not json.loads((tmp_path / "manifest.json").read_text())["complete"]
    assert sorted(tmp_path.rglob("shard_*.npz")) == sorted(saved)
    monkeypatch.setattr(data_mod, "atomic_savez", real)
    first = {p: p.stat().st_mtime_ns for p in saved}
    manifest = cache_hidden_states(target.cfg, target.params, ex, tmp_path, **kw)
    assert {p: p.stat().st_mtime_ns for p in saved} == first  # not recomputed
    sec = manifest["seconds"]
    assert sec.keys() == {"total", "read_back", "wait_for_save"}
    assert 0 <= sec["read_back"] + sec["wait_for_save"] <= sec["total"]
    assert "seconds" not in json.loads((tmp_path / "manifest.json").read_text())
    assert "seconds" not in cache_hidden_states(target.cfg, target.params, ex, tmp_path, **kw)
    serial = tmp_path / "serial"  # the same files as a cache made in one go
    cache_hidden_states(target.cfg, target.params, ex, serial, **kw)
    for split in ("train", "heldout"):
        a, b = load_split(tmp_path, split), load_split(serial, split)
        for f in ("tokens", "assistant", "hidden", "lengths", "index"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f))


def test_row_loss_mask_is_shifted_to_the_predicted_token():
    asst = np.array([0, 0, 1, 1, 0, 1, 0, 0], bool)
    np.testing.assert_array_equal(row_loss_mask(asst, 6), [0, 1, 1, 0, 1, 0, 0, 0])


def test_truncated_json_array_yields_complete_records(tmp_path):
    recs = [{"id": i, "conversations": [{"from": "human", "value": "hi " * i},
                                        {"from": "gpt", "value": "yo"}]} for i in range(1, 6)]
    text = json.dumps(recs, indent=2)
    cut = text.index('"id": 5') - 10  # inside the fifth record
    (tmp_path / "t.json").write_text(text[:cut])
    stats = ReadStats()
    got = list(iter_json_array(tmp_path / "t.json", stats, chunk_chars=64))
    assert got == recs[:4] and stats.truncated_file
    (tmp_path / "full.json").write_text(text)
    stats = ReadStats()
    assert list(iter_json_array(tmp_path / "full.json", stats, chunk_chars=50)) == recs
    assert not stats.truncated_file


def test_normalize_messages_shapes():
    sg = {"conversations": [{"from": "gpt", "value": "orphan"}, {"from": "human", "value": "q"},
                            {"from": "gpt", "value": "a"}]}
    assert normalize_messages(sg) == [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "a"}]
    chat = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                         {"role": "assistant", "content": "a"}]}
    assert normalize_messages(chat) == chat["messages"]
    assert normalize_messages({"conversations": [{"from": "human", "value": "q"}]}) is None
    assert normalize_messages({"conversations": [{"from": "human", "value": ""},
                                                 {"from": "gpt", "value": "a"}]}) is None
    assert normalize_messages({"messages": [{"role": "robot", "content": "x"}]}) is None


def test_chat_rendering_masks_assistant_turns(tmp_path):
    tok = char_tokenizer()
    rec = {"conversations": [{"from": "human", "value": "hi there"},
                             {"from": "gpt", "value": "hello!"},
                             {"from": "human", "value": "and?"},
                             {"from": "gpt", "value": "bye"}]}
    (tmp_path / "d.jsonl").write_text(
        "\n".join(json.dumps(r) for r in (rec, {"messages": [{"role": "user", "content": "x"}]},
                                          {"messages": rec["conversations"]})) + "\n")
    exs, stats = load_examples(tmp_path / "d.jsonl", tokenizer=tok, vocab_size=256, max_len=512,
                               min_tokens=4)
    assert stats.used == 1 and stats.records == 3 and sum(stats.skipped.values()) == 2
    ex = exs[0]
    ids = tok.apply_chat_template([{"role": "user", "content": "hi there"},
                                   {"role": "assistant", "content": "hello!"},
                                   {"role": "user", "content": "and?"},
                                   {"role": "assistant", "content": "bye"}],
                                  tokenize=True, return_dict=False)
    assert ex.tokens.tolist() == list(ids)
    masked = "".join(tok.convert_ids_to_tokens(ex.tokens[ex.assistant].tolist()))
    assert masked == "hello!<|im_end|>\nbye<|im_end|>\n"
    short, _ = load_examples([rec], tokenizer=tok, vocab_size=256, max_len=40, min_tokens=4)
    assert len(short[0].tokens) == 40
    np.testing.assert_array_equal(short[0].assistant, ex.assistant[:40])


def test_target_fingerprint_ignores_fields_at_their_defaults(target):
    """A config field added later with a behaviour-keeping default must not invalidate caches
    made before it existed; any field set away from its default must change the hash."""
    import specjax.train.data as data

    fp = target_fingerprint(target.cfg, target.params)
    fields = data._non_default_fields(target.cfg)
    assert "sliding_window" not in fields and "layer_types" not in fields  # at defaults
    assert "hidden_size" in fields
    windowed = dataclasses.replace(target.cfg, sliding_window=16)
    assert target_fingerprint(windowed, target.params) != fp
    scaled = dataclasses.replace(target.params, embed=target.params.embed * 2)
    assert target_fingerprint(target.cfg, scaled) != fp


def test_sharegpt_conversations_stop_before_the_calibration_records(tmp_path, monkeypatch):
    from specjax.train import data

    path = tmp_path / "sg.jsonl"
    path.write_text("".join(json.dumps({"tokens": list(range(i, i + 20))}) + "\n"
                            for i in range(5)))
    monkeypatch.setattr(data, "sharegpt_path", lambda: path)
    monkeypatch.setattr(data, "CALIBRATION_START", 3)
    got, stats = load_examples("sharegpt", tokenizer=None, vocab_size=256, max_len=32)
    assert len(got) == 3 and stats.records == 3
    assert len(load_examples(path, tokenizer=None, vocab_size=256, max_len=32)[0]) == 5
