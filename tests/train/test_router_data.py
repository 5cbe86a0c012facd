"""Router data collection: the full-vocabulary drafter's expansions, recorded and resumable."""

from __future__ import annotations

import numpy as np
import pytest

from specjax.speculative import TreeSpec
from specjax.train.router import read_router_data
from specjax.train.router_data import collect_router_data
from specjax.vocab.router import fingerprint

PROMPTS = [[5, 6, 7], [10, 11, 12, 13], [40, 41, 42, 43, 44], [7, 8], [20, 21, 22]]
TREE = TreeSpec("eagle2", depth=3, top_k=2, total_tokens=5)


def collect(target, drafter, out, n):
    return collect_router_data(target, drafter, out, source=PROMPTS, num_records=n, top_l=4,
                               tree=TREE, max_new_tokens=8, shard_records=16, progress=False)


def test_records_are_the_drafter_expansions(tiny_target, fitted_drafter, tmp_path):
    meta = collect(tiny_target, fitted_drafter, tmp_path, 30)
    data = read_router_data(tmp_path)
    d = tiny_target.cfg.hidden_size
    assert meta["num_records"] == len(data) >= 30
    assert data.x.shape == (len(data), 2 * d) and data.topl.shape == (len(data), 4)
    assert meta["drafter_fingerprint"] == fingerprint(fitted_drafter.params)
    # Per speculative step: the root (t = 0), then top_k beam nodes at t = 1 and t = 2.
    counts = np.bincount(data.step, minlength=3)
    assert counts[1] == counts[2] == 2 * counts[0] and counts.sum() == len(data)
    # Step-0 contexts are [embedding(root); the target's feature]: the embedding half
    # matches a row of the target's embedding.
    emb = np.asarray(tiny_target.params.embed, np.float16)
    x0 = data.x[data.step == 0][:, :d]
    assert all(np.abs(emb - row).max(axis=1).min() < 1e-3 for row in x0)
    # top-L ids are distinct, in range, and the full head's top-1 comes first.
    assert (data.topl >= 0).all() and (data.topl < tiny_target.cfg.vocab_size).all()
    assert all(len(set(r)) == 4 for r in data.topl.tolist())


def test_collection_resumes(tiny_target, fitted_drafter, tmp_path):
    collect(tiny_target, fitted_drafter, tmp_path, 20)
    first = read_router_data(tmp_path)
    collect(tiny_target, fitted_drafter, tmp_path, 60)  # continues with the next prompts
    both = read_router_data(tmp_path)
    assert len(both) >= 60
    np.testing.assert_array_equal(both.topl[: len(first)], first.topl)


def test_refuses_another_drafters_folder(tiny_target, fitted_drafter, tmp_path):
    import dataclasses

    collect(tiny_target, fitted_drafter, tmp_path, 20)
    other = dataclasses.replace(
        fitted_drafter, params=dataclasses.replace(fitted_drafter.params,
                                                   fc=fitted_drafter.params.fc * 2))
    with pytest.raises(ValueError, match="another drafter"):
        collect(tiny_target, other, tmp_path, 40)


def test_refuses_a_tree_that_skips_expansions(tiny_target, fitted_drafter, tmp_path):
    """A dyspec-threshold tree skips drafter calls at run time (lax.cond), which would
    drop records: refused before anything runs."""
    tree = TreeSpec("dyspec-threshold", depth=3, total_tokens=5, threshold=0.1)
    with pytest.raises(ValueError, match="skips some at run time"):
        collect_router_data(tiny_target, fitted_drafter, tmp_path, source=PROMPTS,
                            num_records=8, tree=tree, progress=False)
    assert not list(tmp_path.glob("shard_*"))


class _Tokenizer:
    """A chat tokenizer, or a base model's (no template: plain text, BOS first)."""

    def __init__(self, chat_template):
        self.chat_template = chat_template

    def encode(self, text):
        return [2, *map(ord, text)]

    def apply_chat_template(self, msgs, **kw):
        assert msgs[0]["role"] == "user" and kw["add_generation_prompt"]
        return [9, *map(ord, msgs[0]["content"]), 9]


def test_prompts_are_plain_text_for_a_base_model(tmp_path):
    import json

    from specjax.train.router_data import first_user_prompts

    data = tmp_path / "sg.jsonl"
    data.write_text("\n".join(json.dumps({"conversations": [
        {"from": "human", "value": q}, {"from": "gpt", "value": "ok"}]})
        for q in ("skipped", "hi", "a question that is far too long")) + "\n")
    base = list(first_user_prompts(data, _Tokenizer(None), skip=1, max_prompt_tokens=8))
    assert base == [[2, ord("h"), ord("i")]]
    chat = list(first_user_prompts(data, _Tokenizer("{{ x }}"), skip=1, max_prompt_tokens=8))
    assert chat == [[9, ord("h"), ord("i"), 9]]


def test_sharegpt_prompts_stop_before_the_calibration_records(tmp_path, monkeypatch):
    """Training prompts (self-distillation, router data) never come from the ShareGPT
    records `bench spec` calibrates on; a file the user names is read whole."""
    import json

    from specjax.train import data as train_data
    from specjax.train import router_data

    data = tmp_path / "sg.jsonl"
    data.write_text("\n".join(json.dumps({"conversations": [
        {"from": "human", "value": q}, {"from": "gpt", "value": "ok"}]})
        for q in ("a", "b", "c", "d")) + "\n")
    monkeypatch.setattr(train_data, "sharegpt_path", lambda: data)
    monkeypatch.setattr(train_data, "CALIBRATION_START", 2)
    tok = _Tokenizer(None)
    assert len(list(router_data.first_user_prompts("sharegpt", tok, skip=0,
                                                   max_prompt_tokens=8))) == 2
    assert len(list(router_data.first_user_prompts(data, tok, skip=0,
                                                   max_prompt_tokens=8))) == 4
