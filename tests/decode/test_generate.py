"""Vanilla decoding: batching, stopping, sampling, recompiles, eager vs compiled."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch

import specjax
from specjax.decode import decode_loop, prefill
from specjax.sampling import SamplingConfig, filter_logits


@pytest.fixture(scope="module")
def target(tiny_llama, tmp_path_factory):
    return specjax.load(specjax.convert(tiny_llama, tmp_path_factory.mktemp("t") / "sj",
                                        progress=False))


PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [40, 41, 42, 43, 44]]


def test_batch_of_ragged_prompts_equals_single_runs(target):
    batch = specjax.generate(target, PROMPTS, max_new_tokens=20, stop_on_eos=False).tokens
    singles = [specjax.generate(target, [p], max_new_tokens=20, stop_on_eos=False).tokens[0]
               for p in PROMPTS]
    assert batch == singles


def test_eager_equals_compiled(target):
    kw = dict(max_new_tokens=17, temperature=0.9, top_k=50, seed=3)
    compiled = specjax.generate(target, PROMPTS, mode="compiled", **kw)
    eager = specjax.generate(target, PROMPTS, mode="eager", **kw)
    assert compiled.tokens == eager.tokens


def test_stops_on_eos_and_budget(target):
    free = specjax.generate(target, PROMPTS[:1], max_new_tokens=30, stop_on_eos=False).tokens[0]
    # Declare the 5th generated token an EOS: generation must end right there.
    eos = free[4]
    stop_at = free.index(eos)
    t = dataclasses.replace(target, cfg=dataclasses.replace(target.cfg, eos_token_ids=(eos,)))
    got = specjax.generate(t, PROMPTS[:1], max_new_tokens=30).tokens[0]
    assert got == free[: stop_at + 1]
    assert len(specjax.generate(target, PROMPTS, max_new_tokens=7,
                                stop_on_eos=False).tokens[1]) == 7


def test_no_recompile_within_a_bucket(target):
    specjax.generate(target, [[1, 2, 3]], max_new_tokens=10)
    sizes = prefill._cache_size(), decode_loop._cache_size()
    # Different prompt length, budget, temperature and seed; same buckets.
    specjax.generate(target, [[4, 5, 6, 7, 8, 9]], max_new_tokens=13)
    specjax.generate(target, [[4, 5, 6, 7]], max_new_tokens=12, temperature=0.5, seed=1)
    specjax.generate(target, [[4, 5, 6, 7]], max_new_tokens=12, temperature=1.5, seed=2)
    assert (prefill._cache_size(), decode_loop._cache_size()) == (sizes[0] + 1, sizes[1] + 1)


def test_sampling_is_seeded(target):
    kw = dict(max_new_tokens=16, temperature=1.0)
    a = specjax.generate(target, PROMPTS, seed=0, **kw).tokens
    assert a == specjax.generate(target, PROMPTS, seed=0, **kw).tokens
    assert a != specjax.generate(target, PROMPTS, seed=1, **kw).tokens
    assert a == specjax.generate(target, PROMPTS, key=jax.random.PRNGKey(0), **kw).tokens


def test_top_k_one_is_greedy(target):
    greedy = specjax.generate(target, PROMPTS, max_new_tokens=12).tokens
    assert specjax.generate(target, PROMPTS, max_new_tokens=12, temperature=2.0, top_k=1,
                            seed=5).tokens == greedy


def test_first_token_distribution(target):
    """Sampled first tokens follow softmax(logits / T) (chi-square, can fail)."""
    from scipy.stats import chisquare

    cfg = target.cfg
    prompt = np.asarray([PROMPTS[0]], np.int32)
    logits, _ = specjax.model.forward(target.params, cfg, prompt, np.arange(3)[None],
                                      specjax.model.init_cache(cfg, 1, 8))
    probs = np.asarray(jax.nn.softmax(logits[0, -1] / 0.7), np.float64)
    probs /= probs.sum()  # float64, so expected and observed totals agree to scipy's 1e-8
    n = 4000
    batch = specjax.generate(target, [PROMPTS[0]] * n, max_new_tokens=1, temperature=0.7,
                             seed=11)
    counts = np.bincount([t[0] for t in batch.tokens], minlength=cfg.vocab_size)
    top = np.argsort(-probs)[:15]
    obs = np.append(counts[top], n - counts[top].sum())
    exp = np.append(probs[top], 1 - probs[top].sum()) * n
    assert chisquare(obs, exp).pvalue > 1e-3


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (20, 1.0), (20, 0.5), (0, 0.3)])
def test_filters_match_transformers(top_k, top_p):
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = np.random.RandomState(0).randn(4, 300).astype(np.float32) * 3
    ref = torch.tensor(logits)
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    s = SamplingConfig(temperature=1.0, top_k=top_k, top_p=top_p)
    got = np.asarray(filter_logits(logits, s.static(), **s.dynamic()))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref.numpy()))


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=250), "exceeds the model's context of 256"),
    (dict(mode="fast"), "mode"),
])
def test_bad_arguments(target, kwargs, message):
    with pytest.raises(ValueError, match=message):
        specjax.generate(target, PROMPTS, **kwargs)


def test_bad_prompts(target):
    with pytest.raises(ValueError, match="outside"):
        specjax.generate(target, [[1, 2, 256]])
    with pytest.raises(ValueError, match="empty"):
        specjax.generate(target, [[]])
    with pytest.raises(ValueError, match="no tokenizer"):
        specjax.generate(target, "text needs a tokenizer")
