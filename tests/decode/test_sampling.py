"""The draw behind every sampled token: ``first_argmax`` and ``categorical`` give exactly
what ``jnp.argmax`` and ``jax.random.categorical`` give, on the values that trip argmax
rewrites (ties, infinities, NaN, rows with one finite logit)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.sampling import categorical, first_argmax

# Few distinct values, so ties are common; the specials argmax rewrites get wrong.
VALUES = st.sampled_from([-np.inf, -2.0, -0.5, 0.0, 0.5, 3.0, np.inf, np.nan])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(VALUES, min_size=7, max_size=7), min_size=1, max_size=5))
def test_first_argmax_is_argmax(rows):
    x = jnp.asarray(rows, jnp.float32)
    got = first_argmax(x)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, jnp.argmax(x, axis=-1))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([(1, 5), (3, 64), (2, 3, 257)]),
       st.floats(0.0, 0.9))
def test_categorical_draws_jax_categoricals_token(seed, shape, masked):
    key_logits, key_mask, key = jax.random.split(jax.random.PRNGKey(seed), 3)
    logits = 3.0 * jax.random.normal(key_logits, shape)
    # Mask a share of the ids (as top-k / top-p filtering does), never a whole row.
    drop = jax.random.uniform(key_mask, shape) < masked
    drop = drop.at[..., 0].set(False)
    logits = jnp.where(drop, -jnp.inf, logits)
    got = categorical(key, logits)
    np.testing.assert_array_equal(got, jax.random.categorical(key, logits, axis=-1))
    assert not np.any(np.take_along_axis(np.asarray(drop), np.asarray(got)[..., None], -1))


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
    """examples/sampling_cost.py: every function checked equal, then timed called and in a
    loop; the JSON holds both for each row count."""
    mod = _sampling_cost()
    out = tmp_path / "cost.json"
    monkeypatch.setattr("sys.argv", ["sampling_cost.py", "--vocab", "300", "--rows", "1,3",
                                     "--runs", "2", "--inner", "3", "--loop-runs", "1",
                                     "--out", str(out)])
    mod.main()
    res = json.loads(out.read_text())
    assert [r["rows"] for r in res["rows"]] == [1, 3] and res["inner"] == 3
    for row in res["rows"]:
        for name in ("jax.random.categorical", "specjax categorical", "jnp.argmax",
                     "first_argmax"):
            assert row[name]["called"]["runs"] == 2
            assert 0 < row[name]["in_loop_ms"] < row[name]["called"]["median_ms"] * 50


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
