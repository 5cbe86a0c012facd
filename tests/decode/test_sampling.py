"""The argmax, the filters and the draw behind every token: ``first_argmax`` gives exactly
what ``jnp.argmax`` gives, on the values that trip argmax rewrites (ties, infinities, NaN);
the thresholds behind top-k and top-p are what a sort finds, ties and infinities included,
and compile to no sort;
``draw`` and ``categorical`` have the law of their weights and logits (chi-square bounds
that a wrong block or id search fails), and never draw an id of zero weight."""

from __future__ import annotations

import importlib.util
import json
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from specjax.sampling import (
    DRAW_BLOCK,
    SamplingConfig,
    _blocks,
    _first_past,
    _key_float,
    _nucleus_among_top,
    _nucleus_mass,
    _order_key,
    _search,
    categorical,
    draw,
    filter_logits,
    first_argmax,
    kth_largest,
    nucleus_threshold,
)

# Few distinct values, so ties are common; the specials argmax rewrites get wrong.
VALUES = st.sampled_from([-np.inf, -2.0, -0.5, 0.0, 0.5, 3.0, np.inf, np.nan])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(VALUES, min_size=7, max_size=7), min_size=1, max_size=5))
def test_first_argmax_is_argmax(rows):
    x = jnp.asarray(rows, jnp.float32)
    got = first_argmax(x)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, jnp.argmax(x, axis=-1))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False), min_size=2, max_size=40))
def test_order_keys_follow_the_floats_and_invert(values):
    x = jnp.asarray(values, jnp.float32)
    k = np.asarray(_order_key(x)).astype(np.int64)
    np.testing.assert_array_equal(
        np.asarray(jax.lax.bitcast_convert_type(_key_float(_order_key(x)), jnp.uint32)),
        np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint32)))  # bit for bit, -0 too
    v = np.asarray(x)
    less, equal = v[:, None] < v[None, :], v[:, None] == v[None, :]
    assert (k[:, None] < k[None, :])[less].all()
    assert (np.abs(k[:, None] - k[None, :]) <= 1)[equal].all()  # only -0 and +0 differ


NO_NAN = st.sampled_from([-np.inf, -2.0, -0.5, 0.0, 0.5, 3.0, np.inf])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(NO_NAN, min_size=7, max_size=7), min_size=1, max_size=5),
       st.integers(1, 7))
def test_kth_largest_is_top_ks_kth_value(rows, k):
    x = jnp.asarray(rows, jnp.float32)
    np.testing.assert_array_equal(kth_largest(x, k)[..., 0], jax.lax.top_k(x, k)[0][..., -1])


@pytest.mark.parametrize("top_k,top_p", [(50, 1.0), (0, 0.9), (50, 0.9)])
def test_filters_do_not_sort_the_row(top_k, top_p):
    """The compiled filter holds no sort over the vocabulary: XLA:CPU sorts a 49,152-id row
    in 8-10 ms, against 0.1 ms for its top-k selection and 0.4 ms for the bisection. A
    ``lax.top_k`` read other than whole (its last value sliced out) compiles to a sort."""
    s = SamplingConfig(temperature=0.7, top_k=top_k, top_p=top_p)
    x = jnp.zeros((6, 49_152), jnp.float32)
    hlo = jax.jit(lambda x, temperature, top_p: filter_logits(x, s.static(), temperature,
                                                               top_p)).lower(
        x, **s.dynamic()).compile().as_text()
    assert " sort(" not in hlo
    if top_k and jax.default_backend() == "cpu":
        assert "TopK" in hlo


def sorted_nucleus(row: np.ndarray, top_p: float) -> tuple[float, float]:
    """The sorted rule in float64: (the smallest kept logit, how near top_p the running
    mass before a kept or dropped id came)."""
    z = np.sort(row[np.isfinite(row)].astype(np.float64))[::-1]
    p = np.exp(z - z[0])
    p /= p.sum()
    before = np.cumsum(p) - p
    # Ties are kept whole: an id is kept when the mass strictly above it is < top_p, the
    # mass before the first id of its tie group.
    above = before[np.searchsorted(-z, -z, side="left")]
    kept = above < top_p
    return z[kept].min(), np.abs(np.concatenate([above, before]) - top_p).min()


NUCLEUS_VALUES = st.sampled_from([-np.inf, -3.0, -1.0, 0.0, 0.5, 2.0, 2.5])
# Compiled once per candidate count: run op by op, the cond and the loop dominate the tests.
nucleus_jit = jax.jit(nucleus_threshold, static_argnums=2)
among_top_jit = jax.jit(_nucleus_among_top, static_argnums=3)


@settings(max_examples=300, deadline=None)
@given(st.lists(NUCLEUS_VALUES, min_size=8, max_size=8).filter(lambda r: np.isfinite(r).any()),
       st.floats(0.01, 1.0), st.sampled_from([1, 3, 8]))
def test_nucleus_threshold_is_the_sorted_rules_last_id(row, top_p, candidates):
    """With 1 or 3 candidates most rows take the bisection, with 8 (the whole row) the
    running sum over the top-k."""
    x = jnp.asarray([row], jnp.float32)
    want, margin = sorted_nucleus(np.asarray(row), top_p)
    if margin < 1e-5:  # within float32 rounding of the boundary: either answer is right
        return
    got = nucleus_jit(x, jnp.float32(top_p), candidates)
    assert float(got[0, 0]) == want


@settings(max_examples=300, deadline=None)
@given(st.lists(NUCLEUS_VALUES, min_size=8, max_size=8).filter(lambda r: np.isfinite(r).any()),
       st.floats(0.01, 0.999), st.integers(1, 8))
def test_nucleus_among_top_says_when_the_nucleus_ends_inside_it(row, top_p, k):
    """The top-k path says it covers a row exactly when the k largest logits hold top_p of
    the mass; its answer is then the sorted rule's, and otherwise the nucleus is wider
    than k ids."""
    x = jnp.asarray([row], jnp.float32)
    want, margin = sorted_nucleus(np.asarray(row), top_p)
    if margin < 1e-5:
        return
    bound, top = _nucleus_mass(x, jnp.float32(top_p))
    found, covered = among_top_jit(x, bound, top, k)
    mass = _mass_of_top(np.asarray(row), k)
    if abs(mass - top_p) < 1e-5:
        return
    assert bool(covered[0, 0]) == (mass >= top_p)
    if covered[0, 0]:
        assert float(found[0, 0]) == want
    else:  # the nucleus reaches past the k-th id
        assert np.sum(np.asarray(row) >= want) > k


def _mass_of_top(row: np.ndarray, k: int) -> float:
    """The probability mass of a row's k largest logits, in float64."""
    z = np.sort(row[np.isfinite(row)].astype(np.float64))[::-1]
    p = np.exp(z - z[0])
    return float(p[:k].sum() / p.sum())


@pytest.mark.parametrize("scale,covered", [(6.0, True), (3.0, False)])
def test_nucleus_threshold_on_a_vocabulary_row(scale, covered):
    """Over SmolLM2's 49,152 ids, several rows at once, per-row top_p, one jitted call:
    logits spread as a model's (nuclei of 1-20 ids, the top-k path) and flatter (nuclei of
    hundreds to thousands, the bisection)."""
    x = scale * jax.random.normal(jax.random.PRNGKey(0), (4, 49_152))
    top_p = jnp.asarray([[0.1], [0.5], [0.9], [0.99]], jnp.float32)
    bound, top = _nucleus_mass(x, top_p)
    assert bool(jnp.all(_nucleus_among_top(x, bound, top, 256)[1])) == covered
    got = np.asarray(jax.jit(nucleus_threshold)(x, top_p))[:, 0]
    checked = 0
    for r in range(4):
        want, margin = sorted_nucleus(np.asarray(x[r]), float(top_p[r, 0]))
        if margin > 1e-6:  # else within float32 rounding of the boundary
            assert got[r] == np.float32(want)
            checked += 1
    assert checked >= 3


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([(1, 5), (3, 64), (2, 3, 257), (2, 700)]),
       st.floats(0.0, 0.99))
def test_categorical_never_draws_a_masked_id(seed, shape, masked):
    key_logits, key_mask, key = jax.random.split(jax.random.PRNGKey(seed), 3)
    logits = 3.0 * jax.random.normal(key_logits, shape)
    # Mask a share of the ids (as top-k / top-p filtering does), never a whole row.
    drop = jax.random.uniform(key_mask, shape) < masked
    drop = drop.at[..., -1].set(False)
    logits = jnp.where(drop, -jnp.inf, logits)
    got = categorical(key, logits)
    assert got.shape == shape[:-1] and got.dtype == jnp.int32
    assert not np.any(np.take_along_axis(np.asarray(drop), np.asarray(got)[..., None], -1))


def _draws(fn, x, n=120_000):
    keys = jax.random.split(jax.random.PRNGKey(3), n)
    return np.asarray(jax.jit(jax.vmap(lambda k: fn(k, x)))(keys))


@pytest.mark.parametrize("v", [5, DRAW_BLOCK, 700, 49_152])
def test_draw_has_the_law_of_its_weights(v):
    """Weights on ids at block edges and inside blocks, zeros elsewhere, not normalised: the
    counts pass a chi-square test against w / sum(w), and no zero-weight id is drawn."""
    ids = np.unique(np.array([0, 1, DRAW_BLOCK - 1, DRAW_BLOCK, 2 * DRAW_BLOCK + 5, v // 2,
                              v - 1]) % v)
    w = np.zeros(v, np.float32)
    w[ids] = np.arange(1, len(ids) + 1, dtype=np.float32) * 0.37
    counts = np.bincount(_draws(draw, jnp.asarray(w)), minlength=v)
    assert counts[w == 0].sum() == 0
    exp = w[ids].astype(np.float64) / w[ids].astype(np.float64).sum() * counts.sum()
    assert chisquare(counts[ids], exp).pvalue > 1e-4


def test_draw_fails_the_test_when_the_law_is_shifted():
    # The same bound rejects draws whose law moved mass between two ids in different blocks.
    v = 700
    w = np.zeros(v, np.float32)
    w[[3, 300, 650]] = [0.2, 0.3, 0.5]
    shifted = w.copy()
    shifted[[3, 300]] = [0.17, 0.33]
    counts = np.bincount(_draws(draw, jnp.asarray(shifted)), minlength=v)
    exp = np.array([0.2, 0.3, 0.5]) * counts.sum()
    assert chisquare(counts[[3, 300, 650]], exp).pvalue < 1e-4


def test_categorical_has_the_softmax_law():
    logits = jnp.asarray([2.0, -jnp.inf, 0.5, -1.0, 1.5] + [-jnp.inf] * 200 + [1.0])
    p = np.asarray(jax.nn.softmax(logits), np.float64)
    p /= p.sum()
    counts = np.bincount(_draws(categorical, logits), minlength=logits.shape[0])
    assert counts[p == 0].sum() == 0
    assert chisquare(counts[p > 0], p[p > 0] * counts.sum()).pvalue > 1e-4


def test_first_past_lands_on_a_positive_part():
    cum = jnp.asarray([[0.5, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.25, 0.5, 0.75, 1.0],
                       [0.5, 0.5 + 1e-7, 0.75, 1.0]])
    part = jnp.asarray([[0.5, 0.5, 0.0, 0.0], [0.0] * 4, [0.25] * 4, [0.5, 0.0, 0.25, 0.25]])
    # Row 0: a threshold that rounding put at the total takes id 1, not a trailing zero.
    # Row 1: all zeros gives 0. Row 2: an exact running sum is not past its threshold.
    # Row 3: an associative scan's rounding stepped the sum up at a zero part: id 2.
    got = _first_past(cum, part, jnp.asarray([1.0, 0.0, 0.5, 0.5]))
    np.testing.assert_array_equal(got, [1, 0, 2, 2])


def test_draw_never_lands_on_a_zero_weight_at_block_edges():
    """Thresholds at every block's running sum, and an ulp either side, on weights whose
    blocks start and end with zeros and span eight orders of magnitude: every id found has
    positive weight (a remainder computed as cum[b] - sum[b] went negative on some)."""
    rng = np.random.default_rng(0)
    w = np.zeros((4, 20 * DRAW_BLOCK), np.float32)
    for r in range(4):
        for b in range(20):
            lo, hi = b * DRAW_BLOCK + 3, (b + 1) * DRAW_BLOCK - 3
            w[r, lo:hi] = 10.0 ** rng.uniform(-4, 4, hi - lo) * (rng.random(hi - lo) < 0.3)
    blocks, block_sum, block_cum = _blocks(jnp.asarray(w))
    edges = np.asarray(block_cum, np.float32)
    for t in (edges, np.nextafter(edges, np.inf), np.nextafter(edges, -np.inf)):
        for b in range(20):
            got = np.asarray(_search(blocks, block_sum, block_cum, jnp.asarray(t[:, b])))
            assert (w[np.arange(4), got] > 0).all(), (b, got)


def test_categorical_edge_rows():
    x = jnp.zeros((3, 300))
    x = x.at[0].set(-jnp.inf)  # every logit -inf: id 0
    x = x.at[1, [7, 200]].set(jnp.inf)  # +inf ids share the row
    x = x.at[2].set(-jnp.inf).at[2, 299].set(-1e30)  # one finite logit, however small
    for k in range(8):
        got = np.asarray(categorical(jax.random.PRNGKey(k), x))
        assert got[0] == 0 and got[1] in (7, 200) and got[2] == 299


def test_categorical_jits_and_keeps_one_finite_logit():
    logits = jnp.full((4, 49_152), -jnp.inf).at[jnp.arange(4), jnp.array([5, 0, 49_151, 77])]\
        .set(0.0)
    draw = jax.jit(categorical)
    for k in range(3):
        np.testing.assert_array_equal(draw(jax.random.PRNGKey(k), logits), [5, 0, 49_151, 77])


def _sampling_cost():
    path = Path(__file__).parents[2] / "examples" / "sampling_cost.py"
    spec = importlib.util.spec_from_file_location("sampling_cost", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sampling_cost_example_times_both_ways_and_writes_json(tmp_path, monkeypatch):
    """examples/sampling_cost.py: every function checked, then timed called and in a loop;
    the JSON holds both for each row count."""
    mod = _sampling_cost()
    out = tmp_path / "cost.json"
    monkeypatch.setattr("sys.argv", ["sampling_cost.py", "--vocab", "300", "--rows", "1,3",
                                     "--runs", "2", "--inner", "3", "--loop-runs", "1",
                                     "--out", str(out)])
    mod.main()
    res = json.loads(out.read_text())
    assert [r["rows"] for r in res["rows"]] == [1, 3] and res["inner"] == 3
    for row in res["rows"]:
        for name in ("jax.random.categorical", "gumbel + first_argmax", "specjax categorical",
                     "jnp.argmax", "first_argmax", "top-k 50 by lax.top_k",
                     "top-k 50 by kth_largest", "top-p 0.9 by sort",
                     "top-p 0.9 by bisection", "top-p 0.9 by nucleus_threshold"):
            assert row[name]["called"]["runs"] == 2
            # No bound against the called time: timings are the benchmark's, and a loop of
            # one run on a busy machine once read 64x the called median here.
            assert 0 < row[name]["in_loop_ms"] < float("inf")


def test_in_loop_ms_is_per_application(monkeypatch):
    """The best loop's time divided by its applications (a fake clock: 6 and 9 ms loops)."""
    mod = _sampling_cost()
    ticks = iter([0.0, 0.006, 1.0, 1.009])  # two timed loops: 6 and 9 ms
    monkeypatch.setattr(mod, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    ms = mod.in_loop_ms(lambda k, x: first_argmax(x), jax.random.PRNGKey(0), jnp.zeros((1, 10)),
                        inner=3, runs=2)
    assert ms == pytest.approx(2.0)


def test_in_loop_ms_applies_the_function_to_nudged_logits_each_time():
    mod = _sampling_cost()
    seen = []

    def fn(key, x):
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), x[0, :7])
        return first_argmax(x)

    mod.in_loop_ms(fn, jax.random.PRNGKey(0), jnp.zeros((1, 10)), inner=4, runs=1)
    # Compile run + one timed loop, four applications each, each on newly nudged logits.
    assert len(seen) == 8
    np.testing.assert_allclose(seen[3], [1e-3, 1e-3, 1e-3, 1e-3, 0, 0, 0], atol=1e-7)
