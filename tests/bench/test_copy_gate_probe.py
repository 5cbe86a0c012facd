"""examples/copy_gate_probe.py's candidates, features and fitted gate."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

_SCRIPT = Path(__file__).parents[2] / "examples" / "copy_gate_probe.py"
_spec = importlib.util.spec_from_file_location("copy_gate_probe", _SCRIPT)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


def test_candidates_are_the_top_then_every_continuation_longest_match_first():
    #          0  1  2  3  4  5  6  7  8  9
    ids = np.array([7, 1, 2, 9, 1, 2, 3, 5, 1, 2])
    # At t = 9 (token 2): 2 occurred at 2 (then 9; suffix "1 2" matches, then 7 vs 5: m=2)
    # and at 5 (then 3; "1 2" then 9 vs 5: m=2); equal matches, the latest first.
    toks, stats = probe.candidates(ids, 9, top=4, most=8)
    assert toks == [4, 3, 9]
    assert stats == [(0, 0, 1), (2, 1, 4), (2, 1, 7)]
    # The top-1 among the continuations keeps its own statistics, listed once.
    toks, stats = probe.candidates(ids, 9, top=9, most=8)
    assert toks == [9, 3] and stats == [(2, 1, 7), (2, 1, 4)]
    assert probe.candidates(ids, 9, top=4, most=2)[0] == [4, 3]  # capped
    assert probe.candidates(ids, 0, top=4, most=8) == ([4], [(0, 0, 1)])  # nothing before
    # Matches stop at MATCH tokens.
    rep = np.array([1] * 20)
    assert probe.candidates(rep, 19, top=1, most=4)[1] == [(probe.MATCH, 19, 1)]


def test_position_features_mark_lookups_only():
    f = probe.position_features(np.array([5.0, 3.0]), [(0, 0, 1), (3, 2, 4)], conf=-0.5)
    assert f.shape == (2, probe.FEATURES)
    assert f[0].tolist() == [0.0] * (probe.FEATURES - 1) + [1.0]  # the top-1: its flag only
    assert f[1, 0] == -2.0 and f[1, 3] == 1.0 and f[1, 1:probe.MATCH + 1].sum() == 1.0
    assert f[1, probe.MATCH + 1:].tolist() == pytest.approx(
        [-0.5, np.log(3.0), np.log(4.0), -2.0, 0.0])


def test_the_fitted_gate_learns_where_the_hidden_state_says_copy():
    """Two candidates a position (the top-1 and a one-token-match copy, 1 logit below); the
    copy is right exactly where the first hidden unit is positive. Only the probe can
    tell, and the fit must find it: 100% against the drafter's 50%."""
    rng = np.random.default_rng(0)
    n, d = 400, 4
    hidden = rng.normal(size=(n, d)).astype(np.float32)
    one = probe.position_features(np.array([0.0, -1.0]), [(0, 0, 1), (1, 1, 3)], conf=-1.0)
    data = {"feat": np.repeat(one[None], n, 0), "mask": np.ones((n, 2), bool),
            "label": (hidden[:, 0] > 0).astype(int), "hidden": hidden,
            "pair": np.zeros(n, int)}
    p = probe.fit(data, lam=1e-4, steps=50)
    hits = probe.gate_hits(p, data)
    assert (data["label"] == 0).mean() == pytest.approx(0.5, abs=0.1)
    assert hits.mean() > 0.97
