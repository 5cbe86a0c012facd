"""Paired runs of several trees on the same prompts (:mod:`specjax.bench.paired`)."""

import pytest

import specjax
from specjax.bench.paired import choose, mal_difference, paired_runs, relative_speed, run_order
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


def _timed(times: list[float], mals: list[float]) -> list[dict]:
    return [{"tokens": 10, "spec_decode_s": t, "mal": m} for t, m in zip(times, mals,
                                                                         strict=True)]


def test_mal_difference_is_paired_over_prompts():
    d = mal_difference(_timed([1, 1, 1], [2.5, 3.5, 4.5]), _timed([1, 1, 1], [2.0, 3.0, 4.0]))
    assert d["diff"] == pytest.approx(0.5) and d["ci95"] == pytest.approx([0.5, 0.5])
    with pytest.raises(ValueError, match="same prompts"):
        mal_difference(_timed([1], [2.0]), _timed([1, 1], [2.0, 2.0]))


def test_choose_takes_the_fastest_or_at_a_speed_tie_the_resolved_higher_mal():
    base = _timed([1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 2.0, 2.0])
    # Resolved on speed: every prompt 20% faster wins, whatever the other's MAL.
    fast = _timed([0.8, 1.6, 2.4, 3.2], [1.5, 1.5, 1.5, 1.5])
    c = choose([base, fast])
    assert (c["chosen"], c["fastest"], c["tied"], c["decided_by"]) == (1, 1, [1], "speed")
    assert c["speed_vs_fastest"][0]["ratio"] == pytest.approx(0.8)
    # A speed tie (faster on two prompts, slower on two) where the fastest has the higher
    # MAL too: the fastest.
    tie = _timed([0.9, 2.1, 2.8, 4.1], [2.5, 2.4, 2.6, 2.5])
    c = choose([base, tie])
    assert c["fastest"] == 1 and c["tied"] == [0, 1]
    assert (c["chosen"], c["decided_by"]) == (1, "speed tie: the fastest")
    # The slower of two tied trees with a resolved higher MAL: it.
    slow_high = _timed([1.02, 1.95, 3.1, 4.05], [2.6, 2.7, 2.8, 2.9])
    c = choose([base, slow_high])
    assert c["fastest"] == 0 and c["tied"] == [0, 1]
    assert (c["chosen"], c["decided_by"]) == (1, "speed tie: the higher MAL")
    assert c["mal_vs_fastest"][1]["diff"] == pytest.approx(0.75)
    # A higher MAL that is not resolved (higher on some prompts, lower on others) does not.
    mixed = _timed([1.02, 1.95, 3.1, 4.05], [3.0, 1.5, 3.0, 1.9])
    assert choose([base, mixed])["chosen"] == 0
    with pytest.raises(ValueError, match="no trees"):
        choose([])
