"""``specjax bench decode``: cheap machinery checks in CI, the real run under ``-m bench``."""

from __future__ import annotations

import json
import math

import jax
import pytest

import specjax
from specjax.bench.common import decode_weight_bytes, measure_bandwidth
from specjax.bench.decode import leading_agreement, run_decode_bench
from specjax.transformers_model import resolve_hf_source
from tests.tiny import make_hf_checkpoint


def _finite_positive(x: float) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_bandwidth_and_weight_bytes(tiny_llama, tmp_path):
    bw = measure_bandwidth(read_mb=8, copy_mb=4, runs=2)
    assert all(_finite_positive(bw[k]) for k in ("read_gb_s", "read_one_gb_s", "copy_gb_s"))
    assert bw["cores"] >= 1
    assert leading_agreement([1, 2, 3], [1, 2, 4, 5]) == 2
    assert leading_agreement([], [1]) == 0

    params = specjax.load(specjax.convert(tiny_llama, tmp_path / "sj", progress=False)).params
    # Untied: the embedding is gathered one row per token, so only that row counts.
    every = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    assert params.lm_head is not None
    assert decode_weight_bytes(params) == every - params.embed.nbytes + params.embed[0].nbytes


def test_run_decode_bench_on_a_tiny_checkpoint(tmp_path):
    hf = make_hf_checkpoint(tmp_path / "hf", "llama", tie_word_embeddings=True)
    model = specjax.convert(hf, tmp_path / "sj", progress=False)
    assert resolve_hf_source(model, None).resolve() == hf.resolve()  # recorded by the conversion
    out = tmp_path / "res" / "bench.json"
    res = run_decode_bench(model, max_new_tokens=6, repeats=1, with_hf=True, out=out,
                           dtype=None, prompt=[1, 17, 42, 99, 5], bandwidth_mb=(64, 32))
    assert out.exists() and out.with_suffix(".png").stat().st_size > 0
    assert json.loads(out.read_text())["prompt_ids"] == [1, 17, 42, 99, 5]
    sj = res["specjax"]
    assert len(sj["compiled"]["tokens"]) == len(res["transformers"]["tokens"]) == 6
    assert sj["eager_matches_compiled"]
    # Random fp32 weights at parity-test precision: greedy choices agree throughout.
    assert res["agreement"]["all_agree"]
    # Tied head: the [V, d] matrix counts once.
    assert res["weight_bytes_per_token"] == sum(
        x.nbytes for x in jax.tree_util.tree_leaves(specjax.load(model).params))
    for v in (res["floor_tokens_per_s"], sj["compiled"]["decode_tokens_per_s"],
              res["ratios"]["speedup_vs_transformers"], res["ratios"]["compiled_vs_eager"]):
        assert _finite_positive(v)


@pytest.mark.bench
def test_decode_bench_smollm2(tmp_path):
    from specjax.defaults import ensure_default_target

    out = tmp_path / "bench_decode.json"
    res = run_decode_bench(ensure_default_target(), max_new_tokens=128, repeats=3, with_hf=True,
                           out=out, dtype=None)
    assert out.exists() and out.with_suffix(".png").stat().st_size > 0
    assert json.loads(out.read_text())["max_new_tokens"] == 128
    assert res["dtype"] == "float32"
    assert len(res["specjax"]["compiled"]["tokens"]) == 128
    for v in (res["bandwidth"]["read_gb_s"], res["bandwidth"]["copy_gb_s"],
              res["floor_tokens_per_s"], res["specjax"]["compiled"]["decode_tokens_per_s"],
              res["specjax"]["eager"]["decode_tokens_per_s"],
              res["transformers"]["tokens_per_s"], *res["ratios"].values()):
        assert _finite_positive(v)
    # Recorded, not required: late fp32 divergence is allowed.
    assert 0 <= res["agreement"]["leading_tokens_agree"] <= 128
    assert set(res["meets_targets"]) == {"speedup_vs_transformers", "fraction_of_floor"}
