"""examples/verify_sampling_ab.py's trees and its revision loader (the timings are the docs')."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

_SCRIPT = Path(__file__).parents[2] / "examples" / "verify_sampling_ab.py"
_spec = importlib.util.spec_from_file_location("verify_sampling_ab", _SCRIPT)
verify_sampling_ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(verify_sampling_ab)


def test_root_of_five_draws_distinct_children_from_the_root_q():
    tokens, parent, valid, p, q = verify_sampling_ab.root_of_five(noise=2.0, seed=1)
    kids = np.asarray(tokens[0, 1:])
    q = np.asarray(q)
    assert len(set(kids.tolist())) == verify_sampling_ab.CHILDREN
    assert (q[0, 0, kids] > 0).all()  # drawn from the root's q, inside its shortlist
    assert np.count_nonzero(q[0, 0]) == verify_sampling_ab.SHORTLIST
    np.testing.assert_allclose(q[0, 0].sum(), 1.0, rtol=1e-5)
    assert not q[0, 1:].any()  # the children are leaves: never expanded
    np.testing.assert_allclose(np.asarray(p).sum(-1), 1.0, rtol=1e-5)
    assert np.asarray(parent).tolist() == [[-1, 0, 0, 0, 0, 0]] and bool(valid.all())


def test_a_revisions_verifier_takes_the_working_trees_decisions():
    """HEAD's verify.py loaded from git: the A/B's own check that both walks agree."""
    res = verify_sampling_ab.calls(verify_sampling_ab.revision_verifier("HEAD"), runs=8)
    assert res["same_decisions"]
    assert 0 < res["revision"]["accept_rate"] == res["working tree"]["accept_rate"]
