"""bench batch: prompts interleaved by task and cut into batches, every row checked against
vanilla at every batch size, pooled per (B, tree), resumable; on the tiny model."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

import specjax
from specjax.bench import batch as batch_bench
from specjax.bench.batch import (
    BatchBenchConfig,
    add_batch_args,
    batches,
    config_from_args,
    default_trees,
    interleave,
    run_batch_bench,
)
from specjax.bench.partial import partial_path, read_partial
from specjax.bench.phases import random_drafter
from specjax.speculative import TreeSpec

PROMPTS = [{"question_id": 1, "task": "qa", "ids": [1, 17, 42, 99, 5]},
           {"question_id": 2, "task": "qa", "ids": [1, 5, 6, 7]},
           {"question_id": 3, "task": "rag", "ids": [1, 60, 61, 62, 60, 61, 62, 60, 61]}]


def test_batches_mix_tasks_in_the_order_of_the_tasks():
    order = interleave(PROMPTS)
    assert [p["question_id"] for p in order] == [1, 3, 2]
    assert [[p["question_id"] for p in b] for b in batches(order, 2)] == [[1, 3], [2]]
    assert len(batches(order, 8)) == 1 and len(batches(order, 1)) == 3


def test_every_row_matches_vanilla_at_every_batch_size(tiny_target, tmp_path, monkeypatch):
    drafter = random_drafter(tiny_target)
    trees = (TreeSpec("chain", depth=2),
             TreeSpec("static", paths=((0,), (1,), (0, 0)), lookup=3, lookup_min=1))
    out = tmp_path / "b.json"
    cfg = BatchBenchConfig(tiny_target.path, batch_sizes=(1, 2), trees=trees, max_new_tokens=8,
                           out=out)
    # Interrupted after the first batch of B=2, then resumed: the B=1 batches and that one
    # are reused.
    calls = []
    real = batch_bench._Runner.__call__

    def counting(self, tree, ids, *seed):
        calls.append((tree, len(ids)))
        if tree is None and len(ids) == 1 and sum(n == 2 for _, n in calls) == 3:
            raise KeyboardInterrupt  # B=2's second batch (one row), after its first
        return real(self, tree, ids, *seed)

    monkeypatch.setattr(batch_bench._Runner, "__call__", counting)
    with pytest.raises(KeyboardInterrupt):
        run_batch_bench(cfg, prompts=PROMPTS, drafter=drafter)
    assert len(read_partial(partial_path(out))) == 4  # 3 at B=1, 1 at B=2
    monkeypatch.setattr(batch_bench._Runner, "__call__", real)
    r = run_batch_bench(cfg, prompts=PROMPTS, drafter=drafter)
    assert r["all_rows_equal"] and r["timed_compiles"] == 0
    assert not partial_path(out).exists() and out.with_suffix(".png").stat().st_size > 0
    labels = r["config"]["labels"]
    assert labels == ["chain d2", "static 0 1 00 +lookup3"]
    for b, n_batches in (("1", 3), ("2", 2)):
        for label in labels:
            x = r["by_batch_size"][b][label]
            assert (x["rows"], x["rows_equal"], x["batches"]) == (3, 3, n_batches)
            assert x["mal"] >= 1.0 and x["speedup"] > 0
            lo, hi = x["speedup_ci95"]
            assert lo <= x["speedup"] <= hi
    # Each batch's rows are the direct call's tokens: vanilla at B=2 equals B=1's.
    first = r["per_batch"][3]
    assert first["b"] == 2 and first["question_ids"] == [1, 3]
    direct = specjax.generate(tiny_target, [PROMPTS[0]["ids"], PROMPTS[2]["ids"]],
                              max_new_tokens=8)
    assert first["vanilla"]["tokens"] == direct.tokens
    assert first["vanilla"]["new_tokens"] == sum(map(len, direct.tokens)) - 2 + 1
    assert "| 2 | chain d2 |" in batch_bench.summary(r)

    # Extending the finished run with a size measures only that size; the others' records
    # come from the finished file (its partial one is gone), unless told not to resume.
    calls.clear()
    monkeypatch.setattr(batch_bench._Runner, "__call__", counting)
    wider = dataclasses.replace(cfg, batch_sizes=(1, 2, 3))
    r3 = run_batch_bench(wider, prompts=PROMPTS, drafter=drafter)
    assert [n for _, n in calls] == [3, 3, 3]  # vanilla and two trees, one batch of 3
    assert r3["per_batch"][:5] == r["per_batch"] and r3["config"]["batch_sizes"] == [1, 2, 3]
    assert r3["by_batch_size"]["3"]["chain d2"]["rows_equal"] == 3
    # Its time counts the reused batches' measuring too, not only this invocation's.
    assert (r3["batches_reused"], r["batches_reused"]) == (5, 4)
    assert r3["measure_s"] == pytest.approx(r["measure_s"] + r3["per_batch"][5]["measure_s"])
    assert r3["measure_s"] > r3["wall_s"] > 0
    calls.clear()
    run_batch_bench(dataclasses.replace(cfg, trees=trees[:1]), prompts=PROMPTS, drafter=drafter)
    assert len(calls) == 10  # other trees: other records, every batch again
    calls.clear()
    run_batch_bench(dataclasses.replace(cfg, trees=trees[:1], resume=False), prompts=PROMPTS,
                    drafter=drafter)
    assert len(calls) == 10


def test_sampled_batches_share_a_seed_a_batch(tiny_target, tmp_path):
    drafter = random_drafter(tiny_target)
    cfg = BatchBenchConfig(tiny_target.path, batch_sizes=(2,), trees=(TreeSpec("chain", depth=2),),
                           max_new_tokens=6, temperature=1.0, seed=5, out=tmp_path / "t.json")
    r = run_batch_bench(cfg, prompts=PROMPTS, drafter=drafter)
    assert r["config"]["greedy"] is False and r["config"]["seed"] == 5
    assert r["all_rows_equal"] is None
    x = r["by_batch_size"]["2"]["chain d2"]
    assert x["rows_equal"] is None and x["rows"] == 3 and x["mal"] >= 1.0
    # Batch k is vanilla's draw with seed 5 + k, without the EOS stop: every row runs the
    # budget, so both methods decode the same number of tokens.
    for k, rec in enumerate(r["per_batch"]):
        ids = [PROMPTS[0]["ids"], PROMPTS[2]["ids"]] if k == 0 else [PROMPTS[1]["ids"]]
        direct = specjax.generate(tiny_target, ids, max_new_tokens=6, temperature=1.0,
                                  seed=5 + k, stop_on_eos=False)
        assert rec["vanilla"]["tokens"] == direct.tokens
        assert all(len(t) == 6 for t in rec["chain d2"]["tokens"])
        assert "mismatches" not in rec["chain d2"]
    assert "sampled at temperature 1" in batch_bench.summary(r)
    with pytest.raises(ValueError, match="never on Spec-Bench's"):  # not a calibration run
        batch_bench.save_batch_defaults(r, tmp_path)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        BatchBenchConfig("m", temperature=float("nan"))
    assert default_trees(drafter, temperature=1.0)[1] == TreeSpec("chain", depth=1)
    # The incumbents run too: the batch tables' trees, greedy ones when sampling, each once.
    lookup, d2 = TreeSpec("chain", depth=1, lookup=4), TreeSpec("chain", depth=2)
    measured = dataclasses.replace(
        drafter, default_tree=d2, batch_trees=((2, lookup), (3, d2), (4, None)),
        sampled_batch_trees=((1.0, ((2, TreeSpec("chain", depth=3)),)),))
    assert default_trees(measured) == [d2, TreeSpec("chain", depth=1), lookup]
    assert default_trees(measured, 0.5) == [d2, TreeSpec("chain", depth=1),
                                            TreeSpec("chain", depth=3), lookup]


def test_sampled_batches_filter_with_top_p(tiny_target, tmp_path):
    """``top_p`` < 1 filters every draw: each batch's vanilla and speculative rows are direct
    calls' with the same ``top_p`` and seed; the run says so, keys its resume on it, and is
    not saved as a batch default (those are keyed by temperature alone)."""
    drafter = random_drafter(tiny_target)
    tree = TreeSpec("chain", depth=2)
    cfg = BatchBenchConfig(tiny_target.path, batch_sizes=(2,), trees=(tree,), max_new_tokens=5,
                           temperature=1.0, top_p=0.5, seed=3, out=tmp_path / "p.json")
    r = run_batch_bench(cfg, prompts=PROMPTS, drafter=drafter)
    assert r["config"]["top_p"] == 0.5
    kw = {"max_new_tokens": 5, "temperature": 1.0, "top_p": 0.5, "stop_on_eos": False}
    for k, rec in enumerate(r["per_batch"]):
        ids = [PROMPTS[0]["ids"], PROMPTS[2]["ids"]] if k == 0 else [PROMPTS[1]["ids"]]
        assert rec["vanilla"]["tokens"] == specjax.generate(tiny_target, ids, seed=3 + k,
                                                            **kw).tokens
        assert rec["chain d2"]["tokens"] == specjax.generate(
            tiny_target, ids, drafter=drafter, tree=tree, vocab="full", seed=3 + k,
            **kw).tokens
    # Filtered and unfiltered draws differ: the filter is in the resume key.
    unfiltered = dataclasses.replace(cfg, top_p=1.0, out=tmp_path / "u.json")
    u = run_batch_bench(unfiltered, prompts=PROMPTS, drafter=drafter)
    assert "top_p" not in u["config"] and u["resume_key"] != r["resume_key"]
    assert ([rec["vanilla"]["tokens"] for rec in u["per_batch"]]
            != [rec["vanilla"]["tokens"] for rec in r["per_batch"]])
    assert "sampled at temperature 1, top-p 0.5 (batch k" in batch_bench.summary(r)
    with pytest.raises(ValueError, match="without --top-p"):
        batch_bench.save_batch_defaults(r | {"config": r["config"] | {"calibration": {"n": 2}}},
                                        tmp_path)
    with pytest.raises(ValueError, match="top_p is in"):
        BatchBenchConfig("m", top_p=0.9)  # greedy: nothing to filter
    with pytest.raises(ValueError, match="top_p is in"):
        BatchBenchConfig("m", temperature=1.0, top_p=0.0)


def test_defaults_and_flags(tiny_target):
    drafter = random_drafter(tiny_target)
    assert default_trees(drafter) == [TreeSpec(), TreeSpec("chain", depth=1)]
    p = argparse.ArgumentParser()
    add_batch_args(p)
    cfg = config_from_args(p.parse_args(["--batch-sizes", "1,4", "--tree-json",
                                         '{"kind": "chain", "depth": 3}']))
    assert cfg.batch_sizes == [1, 4] and cfg.trees == (TreeSpec("chain", depth=3),)
    with pytest.raises(ValueError, match="integers separated by commas"):
        config_from_args(p.parse_args(["--batch-sizes", "1,x"]))
    with pytest.raises(ValueError, match="batch sizes must be >= 1"):
        BatchBenchConfig("m", batch_sizes=(0, 2))
    sampled = p.parse_args(["--temperature", "0.7", "--seed", "3", "--save-default-tree"])
    assert (config_from_args(sampled).temperature, config_from_args(sampled).seed) == (0.7, 3)
    with pytest.raises(ValueError, match="add --calibration 24"):  # before any work
        batch_bench.run_batch_from_args(sampled)
    with pytest.raises(ValueError, match="add --calibration 24"):
        batch_bench.run_batch_from_args(p.parse_args(["--save-default-tree"]))
    assert config_from_args(p.parse_args(["--calibration", "24"])).calibration == 24
    assert config_from_args(p.parse_args(["--temperature", "1", "--top-p", "0.9"])).top_p == 0.9
    with pytest.raises(ValueError, match="drop --top-p"):  # before any work
        batch_bench.run_batch_from_args(p.parse_args(
            ["--temperature", "1", "--top-p", "0.9", "--calibration", "24",
             "--save-default-tree"]))
    with pytest.raises(ValueError, match="calibration takes a number of prompts >= 0"):
        BatchBenchConfig("m", calibration=-2)


def _result(rows: dict[str, dict[str, tuple[float, list[float] | None]]]) -> dict:
    labels = list(next(iter(rows.values())))
    trees = [TreeSpec("chain", depth=1).to_json(), TreeSpec("chain", depth=2).to_json()]
    return {"config": {"labels": labels, "trees": trees[:len(labels)], "vocab": "full",
                       "greedy": True, "calibration": {"source": "sharegpt"}},
            "by_batch_size": {b: {label: {"speedup": sp, "speedup_ci95": ci}
                                  for label, (sp, ci) in row.items()}
                              for b, row in rows.items()},
            "all_rows_equal": True, "machine": {}}


def test_batch_defaults_are_the_fastest_tree_resolved_faster_else_vanilla(tiny_target,
                                                                           tmp_path):
    from flax import nnx

    from specjax.drafter import DrafterConfig, EagleDrafter, save_drafter
    from specjax.tree.default import read_batch_trees, write_default_tree

    r = _result({"1": {"a": (1.7, [1.5, 1.9]), "b": (1.2, [1.1, 1.3])},
                 "2": {"a": (0.8, [0.7, 0.9]), "b": (1.2, [1.1, 1.3])},
                 "3": {"a": (0.6, [0.5, 0.7]), "b": (1.15, [1.05, 1.25])},
                 "4": {"a": (0.4, [0.3, 0.5]), "b": (1.1, [0.99, 1.2])},  # a tie: vanilla
                 "8": {"a": (0.2, [0.2, 0.3]), "b": (0.9, None)}})
    assert batch_bench.batch_choice(r) == {2: 1, 3: 1, 4: None, 8: None}
    both = _result({"2": {"a": (1.3, [1.1, 1.5]), "b": (1.2, [1.1, 1.3])}})
    assert batch_bench.batch_choice(both) == {2: 0}  # the faster of two resolved ones
    # A win above a size where vanilla decoding won is noise: the drafter stays off.
    relapse = _result({"3": {"a": (1.2, [1.1, 1.3])}, "2": {"a": (1.3, [1.1, 1.5])},
                       "10": {"a": (1.2, [1.05, 1.3])}, "4": {"a": (1.0, [0.9, 1.1])}})
    assert batch_bench.batch_choice(relapse) == {2: 0, 3: 0, 4: None, 10: None}

    cfg = DrafterConfig(tiny_target.cfg)
    folder = save_drafter(tmp_path / "d", cfg, EagleDrafter(cfg, rngs=nnx.Rngs(0)).params())
    with pytest.raises(ValueError, match="measure the greedy default first"):
        batch_bench.save_batch_defaults(r, folder)
    write_default_tree(folder, TreeSpec("chain", depth=3), {}, vocab="fr:8192")
    with pytest.raises(ValueError, match="drafted with the head 'full'.*--vocab fr:8192"):
        batch_bench.save_batch_defaults(r, folder)
    write_default_tree(folder, TreeSpec("chain", depth=3), {})
    batch_bench.save_batch_defaults(r, folder, "results/b.json")
    assert read_batch_trees(folder) == ((2, TreeSpec("chain", depth=2)),
                                        (3, TreeSpec("chain", depth=2)), (4, None), (8, None))
    with pytest.raises(ValueError, match="differed from vanilla"):
        batch_bench.save_batch_defaults({**r, "all_rows_equal": False}, folder)
    # A sampled run (no rows compared) stores the sampled table and leaves the greedy one.
    sampled = {**r, "all_rows_equal": None,
               "config": r["config"] | {"greedy": False, "temperature": 1.0, "seed": 0}}
    where = batch_bench.save_batch_defaults(sampled, folder)
    assert read_batch_trees(folder, temperature=1.0) == read_batch_trees(folder)
    assert json.loads(where.read_text())["sampled_batch"]["temperatures"]["1"]["measured"][
        "temperature"] == 1.0
    batch_bench.save_batch_defaults(_result({"2": {"a": (1.3, [1.1, 1.5])}}), folder)
    assert read_batch_trees(folder) == ((2, TreeSpec("chain", depth=1)),)
    assert len(read_batch_trees(folder, temperature=1.0)) == 4
    # One at 0.3 is stored beside the one at 1, which sampling at 0.9 still follows.
    cool = _result({"2": {"a": (1.3, [1.1, 1.5])}})
    cool["config"] |= {"greedy": False, "temperature": 0.3, "seed": 0}
    batch_bench.save_batch_defaults({**cool, "all_rows_equal": None}, folder)
    assert read_batch_trees(folder, temperature=0.3) == ((2, TreeSpec("chain", depth=1)),)
    assert len(read_batch_trees(folder, temperature=0.9)) == 4
    spec_bench = {**r, "config": {k: v for k, v in r["config"].items() if k != "calibration"}}
    with pytest.raises(ValueError, match="never on Spec-Bench's.*--calibration 24"):
        batch_bench.save_batch_defaults(spec_bench, folder)
    with pytest.raises(ValueError, match="no batch size of 2 or more"):
        batch_bench.save_batch_defaults(_result({"1": {"a": (1.7, [1.5, 1.9])}}), folder)


def test_calibration_prompts_replace_spec_bench(tiny_target, tmp_path):
    """``calibration``: the paired A/Bs' calibration prompts (here given), ids c0, c1, ...
    interleaved by kind; the run says so, and only such a run can be saved."""
    cfg = BatchBenchConfig(tiny_target.path, batch_sizes=(2,), trees=(TreeSpec("chain", depth=1),),
                           max_new_tokens=4, calibration=3, out=tmp_path / "c.json")
    r = run_batch_bench(cfg, prompts=PROMPTS, drafter=random_drafter(tiny_target))
    assert r["config"]["calibration"] == {"source": "given"}
    assert r["config"]["prompts"] == ["c0", "c2", "c1"]  # qa, rag, qa: interleaved
    assert r["all_rows_equal"] and r["by_batch_size"]["2"]["chain d1"]["rows"] == 3
