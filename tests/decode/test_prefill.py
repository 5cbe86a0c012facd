"""The chunked prefill: the same cache and states as one pass, and only the chunks it needs."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import loop
from specjax.kernels.cpu_attention import available
from specjax.loop import in_chunks, prefill_chunks, prefill_target
from specjax.model import init_cache
from specjax.runner import Request, SpecRunner
from specjax.sampling import SamplingConfig
from specjax.vocab import resolve_head
from tests.tiny import make_hf_checkpoint

LENGTHS = [5, 29, 17]  # ragged rows of a P = 32 bucket


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("g3")
    return specjax.load(specjax.convert(make_hf_checkpoint(path / "hf", "gemma3"),
                                        path / "sj", progress=False))


def _prefill(target, prompt, lens, chunk, monkeypatch, taps=(0,)):
    monkeypatch.setenv("SPECJAX_PREFILL_CHUNK", str(chunk))
    run = jax.jit(lambda p, x, n: prefill_target(p, target.cfg, x, n, 48, taps))
    return run(target.params, prompt, lens)


def _prompts(lengths, p=32, seed=0):
    rs = np.random.RandomState(seed)
    return (jnp.asarray(rs.randint(3, 256, (len(lengths), p)), jnp.int32),
            jnp.asarray(lengths, jnp.int32))


@pytest.mark.parametrize("chunk", [8, 12, 1])
@pytest.mark.parametrize("model", ["llama", "gemma3"])
def test_chunks_equal_one_pass(tiny_target, gemma3, monkeypatch, chunk, model):
    """Hidden states, taps and cache rows of every row's prompt, for chunks that divide P,
    one that does not (12: padded) and single rows; Gemma 3's sliding window (8) spans
    chunks."""
    target = tiny_target if model == "llama" else gemma3
    prompt, lens = _prompts(LENGTHS)
    h1, c1, t1 = _prefill(target, prompt, lens, 0, monkeypatch)
    hc, cc, tc = _prefill(target, prompt, lens, chunk, monkeypatch)
    np.testing.assert_array_equal(np.asarray(cc.lengths), LENGTHS)
    for b, n in enumerate(LENGTHS):
        np.testing.assert_allclose(hc[b, :n], h1[b, :n], atol=2e-5, rtol=0)
        np.testing.assert_allclose(tc[0][b, :n], t1[0][b, :n], atol=2e-5, rtol=0)
        for layer in range(target.cfg.num_layers):
            np.testing.assert_allclose(cc.k[layer][b, :n], c1.k[layer][b, :n], atol=2e-5)
            np.testing.assert_allclose(cc.v[layer][b, :n], c1.v[layer][b, :n], atol=2e-5)


def test_only_the_longest_rows_chunks_run(tiny_target, monkeypatch):
    """Rows of at most 8 tokens in a 32 bucket: one 8-row chunk runs, the rest stay zero."""
    prompt, lens = _prompts([3, 8])
    hidden, _, _ = _prefill(tiny_target, prompt, lens, 8, monkeypatch)
    assert np.all(np.abs(np.asarray(hidden[:, :8])).sum(-1) > 0)
    np.testing.assert_array_equal(np.asarray(hidden[:, 8:]), 0.0)


@pytest.mark.skipif(not available()[0], reason="the CPU attention kernel is not built here")
@pytest.mark.parametrize(("lengths", "ran"), [([3, 11], 12), ([3, 13], 16), ([2, 16], 16),
                                              ([20, 1], 20)])
def test_the_last_chunk_is_a_tail_where_it_covers_the_rest(tiny_target, monkeypatch, lengths,
                                                           ran):
    """The default chunks (8 rows here) with their 4-row tail: the rest of the longest row
    past whole chunks runs as a tail when it fits one (11: 8 + 4 rows run), as a whole chunk
    when not (13: 16 rows), not at all when there is none (16); the states equal one pass's."""
    monkeypatch.setattr(loop, "PREFILL_CHUNK", 8)
    monkeypatch.setattr(loop, "PREFILL_TAIL", 4)
    monkeypatch.delenv("SPECJAX_PREFILL_CHUNK", raising=False)
    prompt, lens = _prompts(lengths)
    run = jax.jit(lambda p, x, n: prefill_target(p, tiny_target.cfg, x, n, 48, (0,)))
    hidden, cache, taps = run(tiny_target.params, prompt, lens)
    assert np.all(np.abs(np.asarray(hidden[:, :ran])).sum(-1) > 0)
    np.testing.assert_array_equal(np.asarray(hidden[:, ran:]), 0.0)
    h1, c1, t1 = _prefill(tiny_target, prompt, lens, 0, monkeypatch)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(hidden[b, :n], h1[b, :n], atol=2e-5, rtol=0)
        np.testing.assert_allclose(taps[0][b, :n], t1[0][b, :n], atol=2e-5, rtol=0)
        np.testing.assert_allclose(cache.k[1][b, :n], c1.k[1][b, :n], atol=2e-5)


def test_a_pass_sees_the_rows_before_its_chunk(tiny_target):
    """in_chunks hands each pass its block, its positions and lengths = the block's start."""
    seen = []

    def run(block, positions, cache):
        seen.append((block, positions, cache.lengths))
        return (block[0] * 10 + cache.lengths[:, None],), cache

    cfg = tiny_target.cfg
    x = jnp.arange(10, dtype=jnp.int32)[None].repeat(2, 0)
    (out,), cache = jax.jit(lambda x: in_chunks(run, (x,), init_cache(cfg, 2, 12),
                                                jnp.asarray([10, 4]), 4))(x)
    # 10 = two chunks of 4 and one padded to 4; each output is 10 x + its chunk's start.
    np.testing.assert_array_equal(np.asarray(out[0]), 10 * np.arange(10) + np.repeat(
        [0, 4, 8], 4)[:10])
    np.testing.assert_array_equal(np.asarray(cache.lengths), [10, 4])
    assert len(seen) == 2  # traced once inside the loop (and once for its shapes)


@pytest.mark.skipif(not available()[0], reason="the CPU attention kernel is not built here")
def test_chunk_choice(tiny_target, monkeypatch):
    cfg, f32 = tiny_target.cfg, jnp.float32
    monkeypatch.delenv("SPECJAX_PREFILL_CHUNK", raising=False)
    assert prefill_chunks(cfg, f32, 1, 1024, 1200) == (128, 64)
    assert (loop.PREFILL_CHUNK, loop.PREFILL_TAIL) == (128, 64)
    assert prefill_chunks(cfg, f32, 1, 16, 80) == (16, 64)  # one chunk: no tail runs
    # bfloat16 has no CPU attention kernel: one pass, as on accelerators.
    assert prefill_chunks(cfg, jnp.bfloat16, 1, 1024, 1200) == (1024, None)
    monkeypatch.setenv("SPECJAX_PREFILL_CHUNK", "0")
    assert prefill_chunks(cfg, f32, 1, 1024, 1200) == (1024, None)
    monkeypatch.setenv("SPECJAX_PREFILL_CHUNK", "24")
    assert prefill_chunks(cfg, f32, 1, 1024, 1200) == (24, None)


def test_long_prompt_greedy_speculative_equals_vanilla(tiny_target, fitted_drafter):
    """A 150-token prompt runs as three 64-row chunks (P = 256) for the target and the
    drafter; the speculative output still equals vanilla's, token for token."""
    rs = np.random.RandomState(5)
    prompts = [rs.randint(3, 256, 150).tolist(), rs.randint(3, 256, 70).tolist()]
    kw = dict(max_new_tokens=40, stop_on_eos=False)
    vanilla = specjax.generate(tiny_target, prompts, **kw).tokens
    spec = specjax.generate(tiny_target, prompts, drafter=fitted_drafter, **kw)
    assert spec.tokens == vanilla


def test_drafter_prefill_in_chunks_equals_one_pass(tiny_target, fitted_drafter, monkeypatch):
    """spec_prefill's drafter pass runs in the target's chunks: the drafter cache's prompt
    rows, the first root's row and its output (``root_h``) are one pass's."""
    tree = specjax.TreeSpec("chain", depth=2)
    rs = np.random.RandomState(1)
    prompts = [rs.randint(3, 256, n).tolist() for n in LENGTHS]
    states = []
    for chunk in (0, 8):
        monkeypatch.setenv("SPECJAX_PREFILL_CHUNK", str(chunk))
        jax.clear_caches()  # the chunk is read at trace time
        runner = SpecRunner.of(tiny_target, fitted_drafter,
                               resolve_head("full", tiny_target, fitted_drafter), tree,
                               SamplingConfig())
        request = Request.build(tiny_target, prompts, max_new_tokens=8, stop_on_eos=False,
                                sampling=SamplingConfig(), tree=tree, key=jax.random.PRNGKey(0))
        states.append(runner.prefill(request))
    one, chunked = states
    np.testing.assert_array_equal(np.asarray(chunked.root), np.asarray(one.root))
    np.testing.assert_allclose(chunked.root_h, one.root_h, atol=2e-5, rtol=0)
    for b, n in enumerate(LENGTHS):
        for a, c in zip(one.dcache.k + one.dcache.v, chunked.dcache.k + chunked.dcache.v,
                        strict=True):
            np.testing.assert_allclose(c[b, :n + 1], a[b, :n + 1], atol=2e-5, rtol=0)


def test_prefill_chunks_example(tiny_target, tmp_path, monkeypatch):
    """examples/prefill_chunks.py: each setting's states checked against one pass's (8-row
    chunks of a 20-token prompt: rounding only), the caller's setting restored, JSON with
    each setting's ratio to one pass, and the plot written."""
    path = Path(__file__).parents[2] / "examples" / "prefill_chunks.py"
    spec = importlib.util.spec_from_file_location("prefill_chunks", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setenv("SPECJAX_PREFILL_CHUNK", "5")
    out = tmp_path / "chunks.json"
    res = mod.main(["--model", str(tiny_target.path), "--lengths", "5,20", "--chunks",
                    "0,8,default", "--runs", "1", "--rounds", "1", "--out", str(out)])
    assert os.environ["SPECJAX_PREFILL_CHUNK"] == "5"
    rows = json.loads(out.read_text())["rows"]
    assert [(r["length"], r["bucket"], r["chunk"]) for r in rows] == [
        (5, 16, 0), (5, 16, 8), (5, 16, None), (20, 32, 0), (20, 32, 8), (20, 32, None)]
    for r in rows:
        assert r["max_abs_diff"] < 2e-5 and r["ms"] > 0
        assert r["vs_one_pass"] == pytest.approx(r["ms"] / next(
            o["ms"] for o in rows if o["length"] == r["length"] and o["chunk"] == 0))
    assert Path(res["plot"]).stat().st_size > 0
