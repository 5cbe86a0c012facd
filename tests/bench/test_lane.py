"""``specjax bench all``: one folder of results, failures isolated, sizes checked, resumed."""

from __future__ import annotations

import json

import pytest

from specjax.bench import gemm, lane
from specjax.cli import main


@pytest.fixture
def tiny_gemm(monkeypatch):
    """The gemm benchmark on a tiny random head (its parser defaults are read at build)."""
    monkeypatch.setattr(gemm, "SIZES", (16, 32))
    monkeypatch.setattr(gemm, "ROWS", (1,))
    real = gemm.add_gemm_args

    def small(p):
        real(p)
        p.set_defaults(vocab_size=64, hidden_size=8, runs=2)

    monkeypatch.setattr(gemm, "add_gemm_args", small)


def test_lane_runs_isolates_failures_and_resumes(tmp_path, tiny_gemm, monkeypatch, capsys):
    # decode is handed a model folder that does not exist: it fails, the lane goes on.
    monkeypatch.setattr(lane, "LANE", {"decode": ("decode", True), "gemm": ("gemm", False)})
    out = tmp_path / "lane"
    code = main(["bench", "all", "--out", str(out), "--only", "decode,gemm",
                 "--model", str(tmp_path / "no-such-model")])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runs"]["gemm"]["status"] == "ok"
    assert summary["runs"]["decode"]["status"] != "ok" and code == 1
    assert "bench_gemm.json" in summary["files"] and summary["too_large"] == []
    assert json.loads((out / "bench_gemm.json").read_text())
    # A rerun skips what finished and retries what did not.
    capsys.readouterr()
    main(["bench", "all", "--out", str(out), "--only", "gemm"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runs"]["gemm"]["status"] == "done earlier"


def test_lane_flags_files_too_large_to_bring_back(tmp_path, tiny_gemm):
    s = lane.run_all(tmp_path, only=("gemm",), max_file_mib=1e-6)
    assert s["runs"]["gemm"]["status"] == "ok"
    assert "bench_gemm.json" in s["too_large"]


def test_lane_refuses_unknown_names(tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark.*nope"):
        lane.run_all(tmp_path, only=("gemm", "nope"))
