"""Paired runs of several trees on the same prompts (:mod:`specjax.bench.paired`)."""

import pytest

import specjax
from specjax.bench.paired import paired_runs, relative_speed, run_order
from specjax.bench.phases import random_drafter
from specjax.speculative import TreeSpec


def _rows(times: list[float]) -> list[dict]:
    return [{"tokens": 10, "vanilla_decode_s": 1.0, "spec_decode_s": t, "mal": 1.0,
             "chained_fraction": 0.0} for t in times]


def test_relative_speed_is_paired_over_prompts():
    base = _rows([1.0, 2.0, 4.0, 8.0])
    # Every prompt 10% faster: the ratio and every resampled ratio are 1.1, despite the
    # eightfold spread between prompts.
    r = relative_speed(_rows([1 / 1.1, 2 / 1.1, 4 / 1.1, 8 / 1.1]), base)
    assert r["ratio"] == pytest.approx(1.1)
    assert r["ci95"] == pytest.approx([1.1, 1.1])
    # One prompt faster, one slower: the interval straddles the pooled ratio.
    r = relative_speed(_rows([0.5, 2.0, 4.0, 9.0]), base)
    assert r["ratio"] == pytest.approx(15.0 / 15.5)
    assert r["ci95"][0] < r["ratio"] < r["ci95"][1]


def test_relative_speed_refuses_rows_of_other_prompts():
    with pytest.raises(ValueError, match="same prompts"):
        relative_speed(_rows([1.0]), _rows([1.0, 2.0]))


def test_run_order_puts_each_tree_first_equally_often():
    orders = [run_order(3, i) for i in range(6)]
    assert all(sorted(o) == [0, 1, 2] for o in orders)
    assert [o[0] for o in orders] == [0, 1, 2, 0, 1, 2]
    assert run_order(1, 5) == [0]




def test_paired_runs_time_every_tree_on_every_prompt(tiny_target):
    drafter = random_drafter(tiny_target)
    trees = [TreeSpec("chain", depth=1), TreeSpec("chain", depth=2)]
    prompts = [[1, 17, 42, 99, 5], [1, 60, 61, 62]]
    rows = paired_runs(tiny_target, drafter, trees, prompts, max_new_tokens=6, vanilla=True,
                       tasks=["qa", "rag"])
    assert len(rows) == 2 and all(len(r) == 2 for r in rows)
    for tree, tree_rows in zip(trees, rows, strict=True):
        for ids, task, rec in zip(prompts, ["qa", "rag"], tree_rows, strict=True):
            assert rec["task"] == task and rec["prompt_tokens"] == len(ids)
            # stop_on_eos off: every run decodes the whole budget after the prefill's token.
            assert rec["tokens"] == 5
            assert rec["spec_decode_s"] > 0 and rec["vanilla_decode_s"] > 0
            assert 1 <= rec["mal"] <= tree.depth + 1
    r = relative_speed(rows[1], rows[0])
    assert r["ci95"][0] <= r["ratio"] <= r["ci95"][1]
    # Greedy: a tree changes the speed, never the tokens; each record's MAL is its own run's.
    one = specjax.generate(tiny_target, [prompts[0]], drafter=drafter, tree=trees[1],
                           max_new_tokens=6, stop_on_eos=False)
    assert rows[1][0]["mal"] == pytest.approx(one.stats["mean_accepted_length"])
