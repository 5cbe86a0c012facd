"""``specjax bench trees``: the whole pipeline on a tiny random Llama with a fitted drafter
in CI, the real SmolLM2 run under ``-m bench``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.bench import tree_compare
from specjax.bench.partial import partial_path
from specjax.bench.tree_compare import (
    KINDS,
    TreeBenchConfig,
    add_tree_bench_args,
    block_summary,
    choose_threshold,
    config_from_args,
    eagle2_shape,
    plot_paths,
    run_tree_bench,
    static_paths,
    tree_at,
    tree_fields,
    tree_label,
    tree_tiles,
)
from specjax.tree import DraftTree, TreeSpec, ancestors_from_parent, eagle2_sizes, normalize_paths
from tests.speculative.conftest import PROMPTS as FITTED

# Two evaluation prompts the fitted drafter has seen (so paths are accepted and trees are
# deep); the calibration prompt is a third, never evaluated.
EVAL = [{"question_id": 1, "task": "qa", "ids": FITTED[0]},
        {"question_id": 2, "task": "rag", "ids": FITTED[2]}]
CALIB = [FITTED[1]]


def _finite_positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_trees_at_a_budget():
    assert static_paths(4) == ((0,), (1,), (0, 0), (0, 0, 0))
    for t in (1, 2, 4, 8, 16, 32, 64):
        paths = static_paths(t)
        assert len(paths) == t and normalize_paths(paths) == paths  # prefix-closed, ranked
        depth, top_k = eagle2_shape(t)
        assert eagle2_sizes(top_k, depth)[1] >= t
        for kind in KINDS:
            tree = tree_at(kind, t, 0.1)
            assert tree.num_nodes == t + 1, (kind, t)
            assert tree_label(tree).startswith(kind.removesuffix("-topk"))
    assert eagle2_shape(8) == (4, 4) and eagle2_shape(32) == (6, 6)
    capped = tree_at("dyspec-threshold", 8, 0.05)
    assert (capped.depth, capped.frontier) == eagle2_shape(8)
    assert tree_label(capped) == "dyspec-threshold d4 n8 f4 thr0.05"
    assert tree_label(tree_at("dyspec-topk", 8)) == "dyspec n8 top-k"
    root5 = TreeSpec("dyspec-threshold", depth=1, total_tokens=5, threshold=0.001)
    assert tree_label(root5) == "dyspec-threshold d1 n5 thr0.001"
    # Labels key A/B rows and calibration records: the greedy-last twin needs its own.
    assert (tree_label(dataclasses.replace(root5, greedy_children=1))
            == "dyspec-threshold d1 n5 thr0.001 greedy1")
    gated = dataclasses.replace(tree_at("chain", 1), lookup=8, lookup_min=2,
                                copy_bias=(1.0, 3.0))
    assert tree_label(gated) == "chain d1 +lookup8 m2 +copy2"
    assert tree_label(dataclasses.replace(gated, lookup=0)) == "chain d1 +copy2"
    longer = dataclasses.replace(gated, lookup_ngram=5)
    assert tree_label(longer) == "chain d1 +lookup8 m2 g5 +copy2"
    assert tree_fields(tree_at("dyspec-topk", 8))["topk_children"] is True
    with pytest.raises(ValueError, match="needs its threshold"):
        tree_at("dyspec-threshold", 4)
    with pytest.raises(ValueError, match="tree kind"):
        tree_at("medusa", 4)

    # The fastest on the calibration prompts, whatever its MAL; ties go to the larger
    # threshold.
    grid = [{"threshold": 0.3, "mal": 1.5, "decode_tokens_per_s": 30.0},
            {"threshold": 0.1, "mal": 1.7, "decode_tokens_per_s": 31.0},
            {"threshold": 0.03, "mal": 1.8, "decode_tokens_per_s": 31.0}]
    assert choose_threshold(grid) == 0.1

    with pytest.raises(ValueError, match="kinds must be among"):
        TreeBenchConfig("m", kinds=("chain", "medusa"))
    with pytest.raises(ValueError, match="thresholds must lie"):
        TreeBenchConfig("m", thresholds=(0.5, 1.5))
    with pytest.raises(ValueError, match="budgets"):
        TreeBenchConfig("m", budgets=(0, 4))

    p = argparse.ArgumentParser()
    add_tree_bench_args(p)
    cfg = config_from_args(p.parse_args(
        ["--model", "some/dir", "--budgets", "4,8", "--temperatures", "0", "--kinds",
         "chain,dyspec", "--per-task", "1", "--max-new-tokens", "48"]))
    assert (cfg.budgets, cfg.temperatures, cfg.kinds) == ((4, 8), (0.0,), ("chain", "dyspec"))
    assert (cfg.per_task, cfg.max_new_tokens, str(cfg.model_dir)) == (1, 48, "some/dir")
    d = config_from_args(p.parse_args(["--model", "x"]))
    assert (d.budgets, d.temperatures, d.kinds) == ((4, 8, 16, 32), (0.0, 0.6), KINDS)

    from specjax.cli import build_parser

    args = build_parser().parse_args(["bench", "trees", "--model", "x", "--budgets", "4"])
    assert args.budgets == (4,) and callable(args.run)


def _tree(parents: list[list[int]], t: int) -> DraftTree:
    """A batch of trees from parent lists (padding after them), for tile counts."""
    b = len(parents)
    parent = np.zeros((b, t), np.int32)
    valid = np.zeros((b, t), bool)
    for i, ps in enumerate(parents):
        parent[i, : len(ps)] = ps
        valid[i, : len(ps)] = True
    parent[:, 0] = -1
    depth = np.zeros((b, t), np.int32)
    for i in range(b):
        for j in range(1, t):
            depth[i, j] = depth[i, parent[i, j]] + 1 if valid[i, j] else 1
    anc = np.asarray(ancestors_from_parent(jnp.asarray(parent), t))
    anc = np.where(valid[:, :, None], anc, np.eye(t, dtype=bool) | (np.arange(t) == 0))
    zeros = jnp.zeros((b, t), jnp.float32)
    return DraftTree(tokens=jnp.zeros((b, t), jnp.int32), parent=jnp.asarray(parent),
                     depth=jnp.asarray(depth), valid=jnp.asarray(valid),
                     ancestors=jnp.asarray(anc), draft_logp=zeros, score=zeros)


def _tiles(anc: np.ndarray, block: int) -> int:
    n = -(-anc.shape[0] // block)
    return sum(bool(anc[i * block:(i + 1) * block, j * block:(j + 1) * block].any())
               for i in range(n) for j in range(n))


def test_tree_tiles_bfs_against_dfs():
    # Two children of the root, each the head of a 16-long chain, in BFS layout (the
    # chains interleave); DFS makes each chain contiguous. And a 20-node chain + padding.
    t = 33
    bfs_two = [-1, 0, 0] + [i for i in range(1, 31)]
    chain = [-1] + list(range(19))
    tiles = np.asarray(tree_tiles(_tree([bfs_two, chain], t), (32, 16, 8)))
    assert tiles.shape == (2, 7)
    assert tiles[:, -1].tolist() == [33, 20]
    # Brute force on the permuted masks: DFS of two interleaved chains is two blocks.
    dfs_parent = [-1, 0] + list(range(1, 16)) + [0] + list(range(17, 32))
    for i, blk in enumerate((32, 16, 8)):
        bfs_anc = np.asarray(_tree([bfs_two], t).ancestors)[0]
        dfs_anc = np.asarray(_tree([dfs_parent], t).ancestors)[0]
        assert tiles[0, 2 * i] == _tiles(bfs_anc, blk)
        assert tiles[0, 2 * i + 1] == _tiles(dfs_anc, blk)
    assert tiles[0, 4] > tiles[0, 5]  # block 8: DFS needs fewer tiles
    assert tiles[1, 0] == tiles[1, 1]  # a chain is the same in both orders

    recs = [{"valid_nodes": [33, 20], "tiles": {"16": {"bfs": [6, 4], "dfs": [5, 4]}}}]
    s = block_summary(recs)
    assert s["trees"] == 2 and s["mean_valid_nodes"] == 26.5
    assert s["block16"] == {"bfs": 5.0, "dfs": 4.5, "ratio": 5.0 / 4.5, "best_of_both": 4.5,
                            "dfs_fewer": 1, "dfs_more": 0}


def test_pooling_best_budget_and_plots_from_records(tmp_path):
    """The report from synthetic unit records: several budgets, every kind, 32+ nodes."""
    budgets, temps, prompts = (16, 32), (0.0, 0.6), (1, 2)
    cfg = TreeBenchConfig("m", budgets=budgets, temperatures=temps, out=tmp_path / "r.json")
    config = {"budgets": list(budgets), "temperatures": list(temps), "kinds": list(KINDS),
              "blocks": [32, 16], "drafter": "d", "max_new_tokens": 11}
    trees, runs, blocks, calib = {}, [], [], []
    for temp in temps:
        for budget in budgets:
            calib.append({"budget": budget, "temperature": temp, "chosen_threshold": 0.1,
                          "grid": [{"threshold": 0.1, "decode_tokens_per_s": 20.0, "mal": 2.0,
                                    "mean_tree_size": 9.0, "drafted_nodes": 8.0,
                                    "drafter_calls": 3.0, "target_forwards": 5}]})
            for i, kind in enumerate(KINDS):
                tree = tree_at(kind, budget, 0.1)
                label = tree_label(tree)
                trees[label] = tree_fields(tree)
                for q in prompts:
                    # 10 decode tokens in (1 + i) * budget / 16 seconds, 5 forwards for q=1.
                    runs.append({"record": "spec", "tree_kind": kind, "budget": budget,
                                 "label": label, "temperature": temp, "question_id": q,
                                 "new_tokens": 11, "decode_s": (1 + i) * budget / 16,
                                 "accepted_tokens": 10, "target_forwards": 4 + q,
                                 "mean_tree_size": budget / 2 + q,
                                 "greedy_match": True if temp == 0 else None,
                                 "first_mismatch": None, "compiles_while_timed": 0,
                                 "vanilla": {"new_tokens": 11, "decode_s": 1.0,
                                             "compiles_while_timed": 0}})
                blocks.append({"tree_kind": kind, "budget": budget, "temperature": temp,
                               "valid_nodes": [budget + 1] * 2, "same_as_compiled": True,
                               "tiles": {"32": {"bfs": [3, 3], "dfs": [3, 3]},
                                         "16": {"bfs": [6, 6], "dfs": [5, 4]}}})
    r = tree_compare._assemble(cfg, config, [{"question_id": q, "task": "qa", "ids": [1]}
                                              for q in prompts], runs, calib, blocks, trees)
    r |= {"model_name": "tiny", "machine": {"nproc": 2, "loadavg_start": (1.0, 1.0, 1.0)}}
    rows = r["results"]
    assert len(rows) == len(KINDS) * len(budgets) * len(temps)
    row = next(x for x in rows if x["kind"] == "eagle2" and x["budget"] == 32)
    assert row["mal"] == pytest.approx(20 / 11)  # 20 accepted tokens in 5 + 6 forwards
    assert row["mean_tree_size"] == pytest.approx((17 * 5 + 18 * 6) / 11)
    assert row["decode_tokens_per_s"] == pytest.approx(20 / (2 * 3 * 2))
    assert row["vanilla_decode_tokens_per_s"] == 10.0
    assert row["speedup_vs_vanilla"] == pytest.approx(row["decode_tokens_per_s"] / 10)
    assert row["mask_blocks"]["block16"]["ratio"] == pytest.approx(6 / 4.5)
    assert (row["greedy_checked"], row["greedy_matched"]) == ((2, 2) if row["temperature"] == 0
                                                              else (0, 0))
    # Smaller budgets ran faster against the same vanilla, so every kind's best is 16.
    assert len(r["best_budget"]) == len(KINDS) * len(temps)
    assert all(b["budget"] == 16 for b in r["best_budget"])
    large = r["mask_blocks"]["trees_of_32_nodes_or_more"]  # T=32: 33 nodes
    assert large["block32"]["ratio"] == 1.0 and large["block16"]["ratio"] == pytest.approx(6 / 4.5)
    greedy_runs = len(KINDS) * len(budgets) * len(prompts)  # at temperature 0 only
    assert r["greedy_equality"] == {"matched": greedy_runs, "checked": greedy_runs,
                                    "all_match": True, "mismatches": []}
    paths = plot_paths(tmp_path / "r.json")
    tree_compare.plot_mal(r, paths["mal"])
    tree_compare.plot_blocks(r, paths["blocks"])
    assert all(p.stat().st_size > 0 for p in paths.values())
    text = tree_compare.summary(r)
    assert "best budget by tokens/s" in text and "trees of 32+ nodes" in text


def test_tree_bench_pipeline_on_a_tiny_model(tiny_target, fitted_drafter, tmp_path,
                                             monkeypatch, capsys):
    # The fewest settings that run every stage: threshold calibration (two thresholds),
    # vanilla, greedy and sampled runs, the block pass, resume. Compiles dominate (~8 s
    # each on the loaded 2-core machine), so one kind and one budget: the other kinds go
    # through the same code (their trees are checked above), and the pooling over budgets
    # and kinds is tested from records above.
    kinds, temps = ("dyspec-threshold",), (0.0, 0.6)
    out = tmp_path / "res" / "bench_trees.json"
    cfg = TreeBenchConfig(tiny_target.path, per_task=1, max_new_tokens=12, budgets=(2,),
                          temperatures=temps, kinds=kinds, out=out, calib_max_new_tokens=12,
                          thresholds=(0.3, 1e-3), block_prompts=2, blocks=(32, 4),
                          stop_on_eos=False)
    kw = dict(prompts=EVAL, calib_prompts=CALIB, drafter=fitted_drafter)

    # The second prompt's speculative tokens are corrupted, to exercise the mismatch path.
    real_record = tree_compare.generation_record

    def corrupt(res, compiles):
        rec = real_record(res, compiles)
        if "tree" in res.stats and res.stats["prompt_tokens"] == [len(EVAL[1]["ids"])]:
            rec["tokens"] = rec["tokens"][:3] + [(rec["tokens"][3] + 1) % 256] + rec["tokens"][4:]
        return rec

    monkeypatch.setattr(tree_compare, "generation_record", corrupt)
    # Interrupt the first run after all its work: the partial file holds every unit.
    real_plot = tree_compare.plot_mal

    def interrupted(r, path):
        raise KeyboardInterrupt

    monkeypatch.setattr(tree_compare, "plot_mal", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_tree_bench(cfg, **kw)
    units = [json.loads(x) for x in partial_path(out).read_text().splitlines()]
    n_runs = len(temps) * len(kinds) * len(EVAL)
    n_units = len(temps) * (2 + len(kinds) * 2 * len(EVAL))
    assert len(units) == n_units
    assert sum(u["record"] == "spec" for u in units) == n_runs

    # Resume: no generation of any kind may happen.
    def no_work(*a, **k):
        raise AssertionError("a resumed run did new work")

    monkeypatch.setattr(tree_compare, "plot_mal", real_plot)
    monkeypatch.setattr(specjax, "generate", no_work)
    monkeypatch.setattr(tree_compare, "drafted_tiles", no_work)
    res = run_tree_bench(cfg, **kw)
    printed = capsys.readouterr()
    assert "GREEDY MISMATCH" in printed.out + printed.err
    assert "resuming" in printed.out + printed.err
    assert (res["resumed_units"], res["new_units"]) == (n_units, 0)
    assert not partial_path(out).exists()
    assert json.loads(out.read_text())["benchmark"] == "trees"
    for path in plot_paths(out).values():
        assert path.exists() and path.stat().st_size > 0

    # Schema.
    assert {"benchmark", "config", "machine", "mal_note", "mal_counts_bonus_token", "trees",
            "static_tree_rule", "threshold_selection", "vanilla_decode_tokens_per_s",
            "results", "best_budget", "greedy_equality", "mask_blocks", "per_prompt",
            "block_passes", "timed_compiles", "resumed_units", "new_units", "prompts"} <= set(res)
    rows = res["results"]
    assert {(r["kind"], r["budget"], r["temperature"]) for r in rows} == {
        (k, 2, t) for k in kinds for t in temps}
    for r in rows:
        assert set(r) >= {"label", "tree", "prompts", "mal", "mean_tree_size",
                          "decode_tokens_per_s", "vanilla_decode_tokens_per_s",
                          "speedup_vs_vanilla", "greedy_checked", "greedy_matched",
                          "mask_blocks"}
        assert r["tree"]["num_nodes"] == 3 and r["prompts"] == len(EVAL)
        assert 1 <= r["mean_tree_size"] <= 3
        for k in ("decode_tokens_per_s", "vanilla_decode_tokens_per_s", "speedup_vs_vanilla"):
            assert _finite_positive(r[k]), k
        mb = r["mask_blocks"]
        assert mb["trees"] >= 2 and mb["block32"]["bfs"] == mb["block32"]["dfs"] == 1
    assert {(b["kind"], b["temperature"], b["budget"]) for b in res["best_budget"]} == {
        (k, t, 2) for k in kinds for t in temps}
    sel = res["threshold_selection"]["per_budget"]
    assert [(s["budget"], s["temperature"]) for s in sel] == [(2, t) for t in temps]
    for s in sel:
        assert [g["threshold"] for g in s["grid"]] == [0.3, 1e-3]
        assert all(1 <= g["mean_tree_size"] <= 3 and g["mal"] >= 1 for g in s["grid"])
        # Depth 2: the root's call, then one layer's call unless nothing is worth it.
        assert all(_finite_positive(g["decode_tokens_per_s"]) and 1 <= g["drafter_calls"] <= 2
                   for g in s["grid"])
        assert s["chosen_threshold"] == choose_threshold(s["grid"])
        row = next(r for r in rows if r["kind"] == "dyspec-threshold"
                   and r["temperature"] == s["temperature"])
        assert row["tree"]["threshold"] == s["chosen_threshold"]

    # MAL: tokens per target forward with the bonus token counted.
    assert res["mal_counts_bonus_token"] and "bonus token included" in res["mal_note"]
    spec = [x for x in res["per_prompt"] if x["record"] == "spec"]
    assert len(spec) == n_runs
    for x in spec:
        assert len(x["vanilla"]["tokens"]) == len(x["tokens"]) == 12
        assert sum(x["accept_lengths"]) == x["accepted_tokens"] == 12 - 1  # + prefill's
        assert min(x["accept_lengths"]) >= 1 and len(x["accept_lengths"]) == x["target_forwards"]
        assert x["mal"] == pytest.approx(x["accepted_tokens"] / x["target_forwards"])
    for r in rows:
        same = [x for x in spec
                if x["label"] == r["label"] and x["temperature"] == r["temperature"]]
        assert r["mal"] == pytest.approx(sum(x["accepted_tokens"] for x in same)
                                         / sum(x["target_forwards"] for x in same))
    # The fitted drafter's q is nearly flat (~1/200): at 1e-3 the greedy tree drafts and
    # accepts; at 0.3 nothing is worth drafting, and no layer is expanded. Which one the
    # clock picks depends on the machine.
    greedy_grid = {g["threshold"]: g for g in sel[0]["grid"]}
    assert greedy_grid[1e-3]["mal"] > 1.2 and greedy_grid[0.3]["mal"] == 1.0
    assert greedy_grid[0.3]["drafter_calls"] == 1 and greedy_grid[0.3]["mean_tree_size"] == 1
    if sel[0]["chosen_threshold"] == 0.3:
        assert rows[0]["mal"] == 1.0
    else:
        assert rows[0]["mal"] > 1.5

    # Greedy equality: checked at temperature 0 only; the corrupted run is caught.
    eq = res["greedy_equality"]
    assert [x["greedy_match"] for x in spec] == [True, False, None, None]
    assert (eq["checked"], eq["matched"], eq["all_match"]) == (2, 1, False)
    label = rows[0]["label"]
    assert eq["mismatches"] == [{"question_id": 2, "label": label, "first_mismatch": 3}]

    # Block passes: the eager trees are the compiled run's (q2: tokens corrupted there).
    passes = res["block_passes"]
    assert len(passes) == len(temps) * len(kinds) * len(EVAL)
    assert [p["same_as_compiled"] for p in passes] == [True, False] * len(temps)
    for p in passes:
        assert len(p["valid_nodes"]) >= 1 and max(p["valid_nodes"]) <= p["num_nodes"]
    assert res["timed_compiles"] == 0


@pytest.mark.bench
def test_tree_bench_smollm2(tmp_path):
    """The real pipeline with small settings: SmolLM2 and the shipped drafter."""
    from specjax.defaults import default_drafter_dir, ensure_default_target

    out = tmp_path / "bench_trees.json"
    res = run_tree_bench(TreeBenchConfig(
        ensure_default_target(), default_drafter_dir(), per_task=1, max_new_tokens=24,
        budgets=(4, 8), temperatures=(0.0,), tasks=("mt_bench", "qa"), thresholds=(0.1, 0.03),
        block_prompts=1, out=out))
    assert res["greedy_equality"]["all_match"]
    assert all(r["mal"] >= 1 for r in res["results"])
    assert all(p.exists() for p in plot_paths(out).values())
