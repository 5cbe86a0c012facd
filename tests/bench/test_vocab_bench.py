"""bench vocab's pooling, report and plot on synthetic per-prompt records, and the whole
run on the tiny models through any draft tree the flags name."""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import pytest

import specjax.bench.vocab as vocab_bench
from specjax.bench.phases import random_drafter
from specjax.bench.trees import DRAFTER_DEFAULT, resolve_tree, tree_from_args
from specjax.bench.vocab import (
    add_vocab_args,
    plot_vocab,
    run_vocab_bench,
    summarize,
    summary,
)
from specjax.speculative import TreeSpec

TASKS = ["qa", "rag"]


def record(task: str, accepted: int, forwards: int, mismatch=None, decode_s=1.0) -> dict:
    head = {"tokens": [1] * 9, "new_tokens": 9, "decode_s": decode_s,
            "target_forwards": forwards, "accepted_tokens": accepted,
            "mean_accepted_length": accepted / forwards, "mean_shortlist_size": 100.0,
            "shortlist_coverage": 0.5, "mismatch_at": mismatch}
    return {"task": task, "vanilla": {"new_tokens": 9, "decode_s": 0.5}, "fr:8": head}


def test_pooled_mal_is_tokens_per_forward_and_mismatches_count():
    recs = [record("qa", 6, 4), record("qa", 2, 2), record("rag", 9, 3, mismatch=5)]
    s = summarize(recs, "fr:8", {"best_ms": 5.0}, {"best_ms": 10.0}, TASKS)
    assert s["mal"] == 17 / 9
    assert s["mal_per_task"] == {"qa": 8 / 6, "rag": 3.0}
    assert s["draft_speedup_vs_full"] == 2.0 and s["greedy_matches"] == 2
    assert s["decode_tokens_per_s"] == 24 / 3
    assert s["speedup_ci95"] == pytest.approx([0.5, 0.5])  # every prompt at half speed


def test_heads_against_the_full_head_are_paired_over_prompts():
    """``against``: speed and MAL relative to another head, with intervals that resample
    prompts; a head faster on every prompt is resolved faster whatever the spread."""
    recs = [record("qa", 6, 4, decode_s=s) for s in (1.0, 2.0, 4.0)]
    for r, fast in zip(recs, (0.8, 1.5, 3.0), strict=True):
        r["full"] = r["fr:8"]
        r["fr:8"] = {**r["full"], "decode_s": fast, "mean_accepted_length": 1.4}
    got = vocab_bench.against(recs, "fr:8", "full")
    assert got["speed"]["ratio"] == pytest.approx(7.0 / 5.3)
    assert 1.0 < got["speed"]["ci95"][0] <= got["speed"]["ci95"][1]
    assert got["mal"]["diff"] == pytest.approx(-0.1) and got["mal"]["ci95"] == pytest.approx(
        [-0.1, -0.1])


def test_pairs_are_each_head_against_the_bases_once():
    heads = ["full", "fr:8192", "dynaspec", "evospec:8192+256"]
    assert vocab_bench.pairs(heads, None) == [("fr:8192", "full"), ("dynaspec", "full"),
                                              ("evospec:8192+256", "full")]
    assert vocab_bench.pairs(heads, ["fr:8192"]) == [
        ("full", "fr:8192"), ("dynaspec", "fr:8192"), ("evospec:8192+256", "fr:8192")]
    every = vocab_bench.pairs(heads, ["all"])
    assert len(every) == 6 and len({frozenset(p) for p in every}) == 6
    assert every[3:] == [("dynaspec", "fr:8192"), ("evospec:8192+256", "fr:8192"),
                         ("evospec:8192+256", "dynaspec")]
    # Two bases: the pair between them is counted once, against the first named.
    assert vocab_bench.pairs(heads, ["full", "fr:8192"]).count(("fr:8192", "full")) == 1
    assert ("full", "fr:8192") not in vocab_bench.pairs(heads, ["full", "fr:8192"])
    with pytest.raises(ValueError, match=r"names \['fr:2730'\], which --heads does not run"):
        vocab_bench.pairs(heads, ["fr:2730"])


def test_report_and_plot(tmp_path):
    recs = [record("qa", 6, 4), record("rag", 9, 3)]
    head = summarize(recs, "fr:8", {"best_ms": 5.0}, None, TASKS)
    head["speedup_vs_vanilla"] = 0.5
    r = {"config": {"tasks": TASKS}, "heads": {"fr:8": head},
         "vanilla": {"decode_tokens_per_s": 16.0},
         "router_overlap": [{"k": 1, "layer": 1.0, "router": 0.2, "both": 1.2,
                             "overlapped": False}]}
    r["paired"] = [{"head": "fr:8", "base": "full", "speed": {"ratio": 1.1, "ci95": [1.05, 1.15]},
                    "mal": {"diff": -0.02, "ci95": [-0.04, 0.0]}}]
    text = summary(r)
    assert "| fr:8 | 2.14 |" in text and "not overlapped" in text
    assert "0.50× [0.50, 0.50]" in text
    assert "| fr:8 | full | 1.100 [1.050, 1.150] | -0.020 [-0.040, +0.000] |" in text
    assert plot_vocab(r, tmp_path / "v.png").stat().st_size > 0


def test_router_overlap_times_the_layer_and_router_on_real_weights(tiny_target, fitted_drafter):
    """The overlap check runs on the tiny models, with the weights and cache as arguments (a
    closed-over embedding would let XLA fold the gather at compile time)."""
    from specjax.bench.vocab import router_overlap
    from tests.vocab.test_heads import example_heads

    head = example_heads(tiny_target.params.head, fr_rows=8)["dynaspec-pa"]
    got = router_overlap(tiny_target, fitted_drafter, head, k=2, context=16, runs=3)
    assert {"layer", "router", "both", "saved_ms", "noise_ms"} <= set(got)
    assert all(got[name] > 0 for name in ("layer", "router", "both"))


def _tiny_questions_and_heads(tiny_target, tmp_path, monkeypatch):
    """A two-question Spec-Bench file whose texts are the tiny target's ids (it has no
    tokenizer), and two heads: full and a 64-row FR shortlist."""
    ranked = tmp_path / "ranked.npy"
    np.save(ranked, np.arange(tiny_target.cfg.vocab_size)[::-1].copy())
    monkeypatch.setattr(vocab_bench, "question_ids", lambda _, text: json.loads(text))
    lines = [{"question_id": i, "category": c, "turns": [json.dumps(ids)]}
             for i, (c, ids) in enumerate([("qa", [1, 17, 42, 99, 5]),
                                           ("rag", [1, 60, 61, 62, 60, 61, 62, 60])], 1)]
    questions = tmp_path / "question.jsonl"
    questions.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return questions, ["full", f"fr:64:{ranked}"]


def test_heads_compared_on_the_tree_json_names(tiny_target, tmp_path, monkeypatch):
    """``--tree-json`` puts every head on one tree (here a static root of three children
    plus a lookup chain, the shipped greedy tree's shape): the run drafts with it, each head
    stays greedy-equal to vanilla, and the tree is recorded; the EAGLE-2 flags still work."""
    tree = TreeSpec("static", paths=((0,), (1,), (2,)), lookup=4, lookup_min=2)
    p = argparse.ArgumentParser()
    add_vocab_args(p)
    assert tree_from_args(p.parse_args(["--tree-json", json.dumps(tree.to_json())])) == tree
    assert tree_from_args(p.parse_args(["--tree-depth", "2"])) == TreeSpec(depth=2)
    # --tree default: the drafter's measured greedy tree, read once the drafter is loaded.
    assert tree_from_args(p.parse_args(["--tree", "default"])) == DRAFTER_DEFAULT
    with pytest.raises(ValueError, match="names the whole tree"):
        tree_from_args(p.parse_args(["--tree", "default", "--tree-lookup", "8"]))
    measured = dataclasses.replace(random_drafter(tiny_target), default_tree=tree)
    assert resolve_tree(DRAFTER_DEFAULT, measured) == tree
    assert resolve_tree(None, measured) == TreeSpec() and resolve_tree(tree, None) == tree
    with pytest.raises(ValueError, match="has no measured tree.*--save-default-tree"):
        resolve_tree(DRAFTER_DEFAULT, random_drafter(tiny_target))

    questions, heads = _tiny_questions_and_heads(tiny_target, tmp_path, monkeypatch)
    r = run_vocab_bench(tiny_target.path, "random", heads=heads, per_task=1,
                        tasks=["qa", "rag"], max_new_tokens=8, tree=tree, runs=1,
                        questions=questions, out=tmp_path / "v.json")
    assert r["config"]["tree"]["kind"] == "static" and r["config"]["tree"]["lookup"] == 4
    assert r["router_overlap"] == [] and r["prompts"] == 2
    for h in heads:
        assert r["heads"][h]["greedy_matches"] == 2, h
        assert r["heads"][h]["mal"] >= 1.0 and r["heads"][h]["draft_ms"] > 0
    assert r["heads"][heads[1]]["mean_shortlist_size"] <= 64 < r["heads"]["full"][
        "mean_shortlist_size"]
    [vs] = r["paired"]
    assert (vs["head"], vs["base"]) == (heads[1], "full")
    assert vs["speed"]["ci95"][0] <= vs["speed"]["ratio"] <= vs["speed"]["ci95"][1]


def test_heads_compared_sampled_draw_one_seed_a_prompt(tiny_target, tmp_path, monkeypatch):
    """``temperature`` > 0: vanilla and every head draw with the prompt's seed and decode the
    whole budget, no equality is counted, the pairs still are; ``--tree default`` is then
    the drafter's tree for sampling."""
    import specjax
    from specjax.bench.partial import partial_path, read_partial

    questions, heads = _tiny_questions_and_heads(tiny_target, tmp_path, monkeypatch)
    chain, root = TreeSpec("chain", depth=2), TreeSpec("dyspec-threshold", depth=1,
                                                       total_tokens=3, threshold=0.001)
    drafter = dataclasses.replace(random_drafter(tiny_target), default_tree=chain,
                                  sampled_trees=((1.0, root),))
    assert resolve_tree(DRAFTER_DEFAULT, drafter, temperature=1.0) == root
    assert resolve_tree(DRAFTER_DEFAULT, drafter) == chain
    out = tmp_path / "t.json"
    r = run_vocab_bench(tiny_target.path, "random", heads=heads, per_task=1,
                        tasks=["qa", "rag"], max_new_tokens=8, tree=root, runs=1,
                        questions=questions, temperature=1.0, seed=3, out=out)
    assert r["config"]["temperature"] == 1.0 and "chi-square" in r["sampling"]["note"]
    for h in heads:
        assert r["heads"][h]["greedy_matches"] is None and r["heads"][h]["mal"] >= 1.0
    [pair] = r["paired"]
    assert pair["speed"]["ci95"][0] <= pair["speed"]["ratio"] <= pair["speed"]["ci95"][1]
    text = summary(r)
    assert "temperature 1, seeds 3+, no EOS stop. sampled: " in text and "| - |" in text
    # Each prompt's methods drew with its seed (3, then 4), to the budget.
    recs = read_partial(partial_path(out))
    for seed, rec, ids in zip((3, 4), recs, ([1, 17, 42, 99, 5],
                                             [1, 60, 61, 62, 60, 61, 62, 60]), strict=True):
        direct = specjax.generate(tiny_target, [ids], max_new_tokens=8, temperature=1.0,
                                  seed=seed, stop_on_eos=False)
        assert rec["vanilla"]["tokens"] == direct.tokens[0]
        assert all(rec[m]["new_tokens"] == 8 for m in ("vanilla", *heads))
        assert all("mismatch_at" not in rec[h] for h in heads)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        run_vocab_bench(tiny_target.path, "random", heads=heads, temperature=-1.0,
                        questions=questions, out=tmp_path / "bad.json")


def test_heads_compared_on_calibration_prompts_instead_of_spec_bench(tiny_target, tmp_path,
                                                                       monkeypatch):
    """``--calibration N``: the paired A/Bs' calibration prompts replace Spec-Bench's (ids
    c0, c1, ...; their kinds are the tasks), so a head or router is chosen off the
    evaluation; every head is still checked against vanilla."""
    questions, heads = _tiny_questions_and_heads(tiny_target, tmp_path, monkeypatch)
    given = [[1, 17, 42, 99, 5], [1, 60, 61, 62, 60, 61, 62, 60], [1, 5, 6, 7]]
    r = run_vocab_bench(tiny_target.path, "random", heads=heads, max_new_tokens=6,
                        tree=TreeSpec("chain", depth=2), runs=1, questions=questions,
                        calibration=3, calibration_given=given, out=tmp_path / "c.json")
    assert r["prompts"] == 3 and r["config"]["calibration"] == {"source": "given"}
    assert r["config"]["tasks"] == ["given"]
    for h in heads:
        assert r["heads"][h]["greedy_matches"] == 3 and r["heads"][h]["mal_per_task"]["given"]
    assert "3 calibration prompts" in summary(r)
    p = argparse.ArgumentParser()
    add_vocab_args(p)
    assert p.parse_args(["--calibration", "24"]).calibration == 24
    with pytest.raises(ValueError, match="calibration takes a number of prompts >= 0"):
        run_vocab_bench(tiny_target.path, "random", heads=heads, calibration=-1,
                        questions=questions, out=tmp_path / "bad.json")
