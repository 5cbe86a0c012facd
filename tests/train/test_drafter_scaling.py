"""examples/drafter_scaling.py: the stages' learning curve and the goal's cost."""

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

_ROOT = Path(__file__).parents[2]
_spec = importlib.util.spec_from_file_location("drafter_scaling",
                                               _ROOT / "examples" / "drafter_scaling.py")
ds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ds)


def _run(name, src, passes, agreement, shipped=True):
    return {"name": name, "from": src, "token_passes": passes,
            "spec_bench_first_draft": agreement, "shipped": shipped}


def test_an_exact_log_line_is_recovered_and_its_cost_is_the_remaining_doublings():
    # Totals 1M, 4M, 16M, 64M: agreement 0.30 + 0.02 a doubling past 1M.
    runs = [_run("a", None, 1e6, 0.30), _run("b", "a", 3e6, 0.34), _run("c", "b", 12e6, 0.38),
            _run("side", "b", 60e6, 0.20, shipped=False), _run("d", "c", 48e6, 0.42)]
    res = ds.analyse({"goal": 0.50, "runs": runs, "train_rate_token_passes_per_s": {"r": 1e6}})
    assert res["lineage"] == ["a", "b", "c", "d"]  # the unshipped branch is not fitted
    assert res["fit"]["slope_per_doubling"] == pytest.approx(0.02)
    assert res["fit"]["r2"] == pytest.approx(1.0)
    cost = res["cost_to_goal"]["fit"]
    assert cost["doublings"] == pytest.approx(4.0)  # (0.50 - 0.42) / 0.02
    assert cost["token_passes"] == pytest.approx(64e6 * 16)
    assert cost["hours"]["r"] == pytest.approx(64e6 * 15 / 1e6 / 3600)
    # Every consecutive pair lies on the line, so the slowest and fastest agree with it.
    assert res["cost_to_goal"]["slowest pair"]["doublings"] == pytest.approx(4.0)
    side = next(p for p in res["points"] if p["run"] == "side")
    assert side["token_passes"] == pytest.approx(64e6) and not side["shipped"]


def test_a_short_fine_tune_gives_no_pair_slope():
    runs = [_run("a", None, 1e6, 0.30), _run("b", "a", 1e6, 0.34), _run("c", "b", 1e4, 0.35)]
    chain = ds.lineage(runs)
    pairs = ds.pair_slopes(chain, ds.cumulative(runs))
    assert [(p["from"], p["to"]) for p in pairs] == [("a", "b")]
    assert pairs[0]["slope_per_doubling"] == pytest.approx(0.04)


def test_bad_records_are_refused():
    with pytest.raises(ValueError, match="does not hold"):
        ds.cumulative([_run("a", "ghost", 1e6, 0.3)])
    with pytest.raises(ValueError, match="loops"):
        ds.cumulative([_run("a", "b", 1e6, 0.3), _run("b", "a", 1e6, 0.3)])
    with pytest.raises(ValueError, match="never reaches"):
        ds.cost_to_goal(1e6, 0.3, 0.0, 0.65)
    with pytest.raises(ValueError, match="two or more"):
        ds.fit_log2(np.array([1e6, 1e6]), np.array([0.3, 0.4]))
    with pytest.raises(ValueError, match="no shipped run"):
        ds.lineage([_run("a", None, 1e6, 0.3, shipped=False)])


def test_the_record_matches_the_shipped_drafter():
    """The record's lineage adds up to the token-passes the shipped drafter's manifest
    counts, and the last shipped stage's agreement is the one docs/benchmarks.md quotes."""
    record = json.loads(ds.RECORD.read_text())
    res = ds.analyse(record)
    manifest = json.loads((_ROOT / "specjax" / "assets" / "drafters" / "SmolLM2-135M-Instruct"
                           / "specjax.json").read_text())
    seen = manifest["meta"]["tokens_seen_total"]
    assert res["now"]["token_passes"] == pytest.approx(seen, rel=0.01)
    assert res["now"]["agreement"] == pytest.approx(0.453)
    assert res["fit"]["slope_per_doubling"] > 0
    assert all(math.isfinite(c["doublings"]) for c in res["cost_to_goal"].values())
