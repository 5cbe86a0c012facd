"""examples/calibration_budget.py: a finished run's estimate re-priced with other counts."""

import importlib.util
from pathlib import Path

import pytest

from specjax.bench.spec_select import step_estimate
from specjax.speculative import TreeSpec

_SCRIPT = Path(__file__).parents[2] / "examples" / "calibration_budget.py"
_spec = importlib.util.spec_from_file_location("calibration_budget", _SCRIPT)
cb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cb)

CURVE = {"sizes": [1, 2, 4, 8], "fit_ms": [10.0, 11.0, 12.0, 16.0]}
SHORT = TreeSpec("chain", depth=1, lookup=2, lookup_min=2)  # 4 nodes, 2 without the chain
LONG = TreeSpec("chain", depth=1, lookup=6, lookup_min=2)   # 8 nodes


def _row(label, tree, est, draft_ms=2.0):
    return {"label": label, "tree": tree.to_json(), "est_tokens_per_s": est,
            "draft_ms": draft_ms}


def test_step_estimate_prices_the_chain_only_on_the_steps_that_grafted_it():
    e = step_estimate(CURVE, LONG, mal=3.0, chained=0.25, draft_ms=2.0)
    verify = 0.25 * 16.0 + 0.75 * 11.0  # 8 rows on a quarter of the steps, 2 on the rest
    assert e["verify_ms"] == pytest.approx(verify)
    assert e["step_ms"] == pytest.approx(verify + 2.0)
    assert e["est_tokens_per_s"] == pytest.approx(3e3 / (verify + 2.0))
    assert e["est_speedup"] == pytest.approx(3.0 * 10.0 / (verify + 2.0))
    plain = step_estimate(CURVE, TreeSpec("chain", depth=3), mal=2.0, chained=None,
                          draft_ms=1.0)
    assert plain["verify_ms"] == pytest.approx(12.0)


def test_new_counts_can_reverse_the_estimates_order_to_the_ab_s():
    result = {"tree_selection": {
        "latency": CURVE,
        "grid": [_row("short", SHORT, 100.0), _row("long", LONG, 90.0),
                 _row("uncounted", TreeSpec("chain", depth=2), 50.0)],
        "ab": {"results": [{"label": "short", "vs_fastest": {"ratio": 0.9}},
                           {"label": "long", "vs_fastest": {"ratio": 1.0}}]}}}
    counts = {"short": {"mal": 2.0, "chained": 0.5}, "long": {"mal": 3.5, "chained": 0.5}}
    rows = cb.reestimate(result, counts)
    assert [r["label"] for r in rows] == ["short", "long"]  # grid order, counted trees only
    assert rows[1]["new"] == pytest.approx(
        step_estimate(CURVE, LONG, mal=3.5, chained=0.5, draft_ms=2.0)["est_tokens_per_s"])
    order = cb.ab_order(result, rows)
    assert [k for k, _ in order["ab"]] == ["long", "short"]
    assert [k for k, _ in order["old"]] == ["short", "long"]
    assert [k for k, _ in order["new"]] == ["long", "short"]
    assert order["ab"][1][1] == pytest.approx(0.9) and order["new"][0][1] == 1.0
