"""examples/sampled_tree_calibration.py: sampled MAL per tree (resumed call by call), step
times, and the paired interval on the MAL difference."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

import specjax
from specjax.drafter import DrafterConfig, EagleDrafter, save_drafter
from specjax.tree import TreeSpec
from specjax.tree.default import read_defaults, write_default_tree, write_sampled_default_tree

_SCRIPT = Path(__file__).parents[2] / "examples" / "sampled_tree_calibration.py"
_spec = importlib.util.spec_from_file_location("sampled_tree_calibration", _SCRIPT)
calib = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(calib)


def test_mal_difference_is_paired_over_units():
    base = np.array([[10, 10], [40, 10], [90, 10], [20, 10]], np.float64)  # MAL 1, 4, 9, 2
    # Every unit one token a forward better: every resample differs by exactly 1.
    lo, hi = calib.mal_difference_ci(base + [[10, 0]], base)
    assert lo == pytest.approx(1.0) and hi == pytest.approx(1.0)
    worse = base.copy()
    worse[2, 0] = 50  # one unit worse, the rest equal: the interval reaches below 0
    lo, hi = calib.mal_difference_ci(worse, base)
    assert lo < 0 and hi == pytest.approx(0.0)


def test_timed_prompts_span_the_calibration_lengths():
    prompts = [[0] * n for n in (700, 40, 300, 1000, 90, 60, 500, 120, 800, 30)]
    lens = [len(p) for p in calib.length_stratified(prompts, 4)]
    assert lens == [30, 90, 500, 1000]  # ranks 0, 3, 6, 9 of ten: both ends, sorted
    assert [len(p) for p in calib.length_stratified(prompts, 1)] == [300]  # the median rank
    assert len(calib.length_stratified(prompts, 20)) == len(prompts)


def test_mal_and_step_times_on_a_tiny_model(tiny_target, tmp_path):
    drafter = EagleDrafter(DrafterConfig(tiny_target.cfg), rngs=nnx.Rngs(0))
    d = specjax.load_drafter(save_drafter(tmp_path / "d", drafter.cfg, drafter.params()),
                             tiny_target)
    trees = [TreeSpec("chain", depth=1),
             TreeSpec("dyspec-threshold", depth=1, total_tokens=2, threshold=0.001)]
    prompts = [[1, 17, 42, 99], [3, 5, 7], [8, 9, 10, 11, 12]]
    done, saves = {}, []
    kw = dict(temperature=1.0, seeds=2, batch=3, max_new_tokens=6)
    mal = calib.sampled_mal(tiny_target, d, trees, prompts, done=done,
                            save=lambda: saves.append(1), **kw)
    assert len(done) == len(saves) == 2 * 2  # trees x seeds (one batch)
    for tree in trees:
        x = mal[calib._key(tree)]
        assert x.shape == (len(prompts) * 2, 2)
        assert np.all(x[:, 0] >= x[:, 1]) and np.all(x[:, 1] >= 1)  # >= 1 token a forward
    # A second run resumes: nothing is generated again.
    again = calib.sampled_mal(tiny_target, d, trees, prompts, done=done,
                              save=lambda: saves.append(1), **kw)
    assert len(saves) == 4 and all(np.array_equal(again[k], mal[k]) for k in mal)
    ms = calib.step_times(tiny_target, d, trees, prompts[:1], temperature=1.0, reps=2,
                          max_new_tokens=6)
    assert set(ms) == {"vanilla", *map(calib._key, trees)}
    assert all(v > 0 for v in ms.values())


def test_save_choice_greedy_keeps_head_and_sampled_tree(tmp_path):
    chain = TreeSpec("chain", depth=1, lookup=8, lookup_min=2)
    n2 = TreeSpec("dyspec-threshold", depth=1, total_tokens=2, threshold=0.001)
    write_default_tree(tmp_path, chain, {"how": "bench spec"}, vocab="fr:8192")
    write_sampled_default_tree(tmp_path, n2, {"how": "t=1"}, temperature=1.0)
    two = TreeSpec("static", paths=((0,), (1,)), lookup=8, lookup_min=2)
    calib.save_choice(tmp_path, two, {"how": "t=0"}, temperature=0.0)
    assert read_defaults(tmp_path) == (two, "fr:8192", ((1.0, n2),), (), (), None)
    calib.save_choice(tmp_path, chain, {"how": "t=1 again"}, temperature=1.0)
    assert read_defaults(tmp_path) == (two, "fr:8192", ((1.0, chain),), (), (), None)
    calib.save_choice(tmp_path, two, {"how": "t=0.3"}, temperature=0.3)  # beside the one at 1
    assert read_defaults(tmp_path) == (two, "fr:8192", ((0.3, two), (1.0, chain)), (), (), None)


@pytest.mark.parametrize("flags", [["--timing-reps", "1"], ["--timing-prompts", "0"]])
def test_a_timing_that_would_time_nothing_is_refused(monkeypatch, capsys, flags):
    """One pass is the compiling one, which is dropped: it once printed 0 ms a step and
    nan x vanilla after the whole MAL run. Refused before anything loads."""
    monkeypatch.setattr(sys, "argv", ["sampled_tree_calibration.py", "--tree-json",
                                      '{"kind": "chain", "depth": 1}', *flags])
    with pytest.raises(SystemExit) as e:
        calib.main()
    assert e.value.code == 2
    assert "the first pass, which compiles, is dropped" in capsys.readouterr().err
