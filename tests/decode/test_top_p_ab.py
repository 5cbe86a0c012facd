"""examples/top_p_ab.py's pieces (its timings are the docs'): the nucleus widths it reports
are the sorted rule's, and both thresholds it swaps into the loop agree and count their
traces."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.sampling import nucleus_threshold

_SCRIPT = Path(__file__).parents[2] / "examples" / "top_p_ab.py"
_spec = importlib.util.spec_from_file_location("top_p_ab", _SCRIPT)
top_p_ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(top_p_ab)


def test_nucleus_widths_count_the_ids_top_p_keeps():
    x = 4.0 * jax.random.normal(jax.random.PRNGKey(1), (5, 3000))
    for top_p in (0.3, 0.9, 0.99):
        kept = np.asarray((x >= nucleus_threshold(x, jnp.float32(top_p))).sum(-1))
        np.testing.assert_array_equal(top_p_ab.nucleus_widths(np.asarray(x), top_p), kept)
    assert (top_p_ab.nucleus_widths(np.asarray(x), 1e-6) == 1).all()
    # Ties are kept whole: three ids share the top logit, so a tiny top_p keeps all three.
    tied = np.array([[2.0, 5.0, 5.0, 1.0, 5.0]])
    np.testing.assert_array_equal(top_p_ab.nucleus_widths(tied, 1e-6), [3])
    np.testing.assert_array_equal(
        (tied >= np.asarray(nucleus_threshold(jnp.asarray(tied, jnp.float32), 1e-6))).sum(-1),
        [3])


def test_both_thresholds_agree_and_count_their_traces():
    traces = {name: 0 for name in top_p_ab.BLOCKS}
    ways = top_p_ab.thresholds(traces)
    # Rows whose nucleus fits in the top-k path's candidates, and flat rows that do not.
    for rows, scale in ((3, 8.0), (4, 0.5)):  # two shapes: each way traced twice
        x = scale * jax.random.normal(jax.random.PRNGKey(2), (rows, 4096))
        got = [jax.jit(fn)(x, jnp.float32(0.9)) for fn in ways.values()]
        np.testing.assert_array_equal(got[0], got[1])
    assert traces == {"bisection": 2, "top-k path": 2}
