"""``specjax bench gemm`` on a tiny head: the flags, the JSON fields and the plot."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from specjax.bench.gemm import add_gemm_args, run_gemm_bench, run_gemm_from_args
from specjax.kernels.cpu_rowdot import available


def _finite_positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_gemm_bench_tiny(tmp_path):
    p = argparse.ArgumentParser()
    add_gemm_args(p)
    out = tmp_path / "res" / "gemm.json"
    args = p.parse_args(["--vocab-size", "4096", "--hidden-size", "64", "--rows", "1,3",
                         "--sizes", "512,256", "--runs", "2", "--out", str(out)])
    res = run_gemm_from_args(args)
    assert out.with_suffix(".png").stat().st_size > 0
    on_disk = json.loads(out.read_text())
    assert on_disk["sizes"] == [256, 512] and on_disk["rows"] == [1, 3]
    # The CPU rowdot kernel takes float32 rows where it is built, else XLA.
    impl = "rowdot" if available()[0] else "xla"
    assert on_disk["impl"] == impl and on_disk["impl_by_rows"] == {"N=1": impl, "N=3": impl}
    assert on_disk["vocab_size"] == 4096
    assert on_disk["results"].keys() == {"N=1", "N=3"} == res["results"].keys()
    for per_n in on_disk["results"].values():
        assert _finite_positive(per_n["full_head_ms"]) and _finite_positive(
            per_n["full_head_gb_s"])
        for method in ("gathered", "dense"):
            for field in ("ms", "median_ms", "speedup", "gb_s"):
                values = per_n[method][field]
                assert len(values) == 2 and all(map(_finite_positive, values)), (method, field)


def test_gemm_bench_rejects_sizes_beyond_the_vocabulary(tmp_path):
    with pytest.raises(ValueError, match="shortlist sizes"):
        run_gemm_bench(vocab_size=128, hidden_size=8, sizes=(64, 256), out=tmp_path / "x.json")
