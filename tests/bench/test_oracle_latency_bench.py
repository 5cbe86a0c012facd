"""``specjax bench oracle`` and ``specjax bench latency`` end to end on a tiny random Llama:
the records they write, the ceilings they derive from them, and their plots."""

from __future__ import annotations

import json
import math

import pytest

from specjax.bench.latency import run_latency_bench
from specjax.bench.oracle import run_oracle_bench
from tests.tiny import make_word_target


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The oracle bench takes text prompts."""
    return make_word_target(tmp_path_factory.mktemp("oracle_latency"))


def test_oracle_bench_accepts_every_draft(tiny_model, tmp_path):
    out = tmp_path / "oracle.json"
    n, depths = 12, (1, 3)
    r = run_oracle_bench(tiny_model, prompts=("the cat sat on a mat",), depths=depths,
                         max_new_tokens=n, runs=1, out=out, latency_runs=1)
    assert json.loads(out.read_text())["depths"] == list(depths)
    assert out.with_suffix(".png").stat().st_size > 0
    for dep in depths:
        rec = r["per_prompt"][0][f"chain{dep}"]
        assert rec["greedy_match"] and rec["eager_greedy_match"]
        # The oracle drafts the recorded continuation: every step but the budget-cut last
        # commits depth + 1 tokens, so the forwards are ceil((n - 1) / (depth + 1)).
        assert rec["target_forwards"] == math.ceil((n - 1) / (dep + 1))
        o = r["overall"][f"chain{dep}"]
        assert o["ceiling_speedup"] == pytest.approx(
            o["mal"] * o["forward_t1_ms"] / o["forward_ms"])
    assert r["goal"]["met"] is None  # depth 4 not run


def test_latency_bench_curve_and_plot(tiny_model, tmp_path):
    out = tmp_path / "latency.json"
    r = run_latency_bench(tiny_model, sizes=(4, 1, 2, 2), context=8, capacity=16, runs=1,
                          out=out, label="tiny")
    assert r["sizes"] == [1, 2, 4]  # sorted, deduplicated
    assert all(b > 0 and math.isfinite(b) for b in r["best_ms"])
    assert r["ratio_to_t1"][0] == 1.0
    assert out.with_suffix(".png").stat().st_size > 0
    again = run_latency_bench(tiny_model, sizes=(1,), context=8, capacity=16, runs=1,
                              out=tmp_path / "again.json", compare=out)
    assert again["compare"]["label"] == "tiny" and again["compare"]["sizes"] == [1, 2, 4]
    with pytest.raises(ValueError, match="exceeds capacity"):
        run_latency_bench(tiny_model, sizes=(9,), context=8, capacity=16, runs=1,
                          out=tmp_path / "bad.json")
