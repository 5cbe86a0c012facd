"""examples/sampled_speedup.py's pooling of per-prompt rows into one tree's figures."""

import importlib.util
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).parents[2] / "examples" / "sampled_speedup.py"
_spec = importlib.util.spec_from_file_location("sampled_speedup", _SCRIPT)
sampled_speedup = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sampled_speedup)


def test_pooled_weighs_prompts_by_their_tokens():
    rows = [{"tokens": 100, "vanilla_decode_s": 4.0, "spec_decode_s": 2.0, "mal": 2.0,
             "chained_fraction": 0.5},
            {"tokens": 20, "vanilla_decode_s": 1.0, "spec_decode_s": 2.0, "mal": 1.0,
             "chained_fraction": 0.0}]
    p = sampled_speedup.pooled(rows)
    assert p["prompts"] == 2
    assert p["vanilla_tokens_per_s"] == pytest.approx(120 / 5.0)
    assert p["spec_tokens_per_s"] == pytest.approx(120 / 4.0)
    # Summed times, not the mean of per-prompt ratios (2.0 and 0.5 would average 1.25).
    assert p["speedup"] == pytest.approx(5.0 / 4.0)
    # Two prompts resampled: a quarter of the draws take one prompt twice, so the interval's
    # ends are the prompts' own ratios, 0.5 and 2.0.
    lo, hi = p["speedup_ci95"]
    assert lo == pytest.approx(0.5) and hi == pytest.approx(2.0)
    assert p["mal"] == pytest.approx(1.5)
    assert p["chained_fraction"] == pytest.approx(0.25)


def test_a_long_share_outside_0_1_is_refused_before_the_model_loads(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["sampled_speedup.py", "--calibration", "8",
                                      "--long-share", "1.5"])
    with pytest.raises(SystemExit) as e:
        sampled_speedup.main()
    assert e.value.code == 2
    assert "--long-share must be in [0, 1], got 1.5" in capsys.readouterr().err


def test_by_length_splits_the_paired_ratio_at_the_prompt_length():
    base = [{"prompt_tokens": n, "tokens": 10, "spec_decode_s": 1.0} for n in (50, 100, 600, 900)]
    # Twice as fast on the short prompts, half as fast on the long ones.
    rows = [{**r, "spec_decode_s": 0.5 if r["prompt_tokens"] < 450 else 2.0} for r in base]
    out = sampled_speedup.by_length(rows, base, 450)
    assert list(out) == ["under 450", "450 and over"]
    assert out["under 450"]["prompts"] == 2 and out["under 450"]["ratio"] == pytest.approx(2.0)
    assert out["450 and over"]["ratio"] == pytest.approx(0.5)
    assert list(sampled_speedup.by_length(rows, base, 10)) == ["10 and over"]  # none under


def test_a_model_without_a_shipped_drafter_is_refused(tiny_target, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["sampled_speedup.py", "--model", str(tiny_target.path)])
    with pytest.raises(SystemExit) as e:
        sampled_speedup.main()
    assert e.value.code == 2
    assert f"no drafter is shipped for {tiny_target.path}" in capsys.readouterr().err
