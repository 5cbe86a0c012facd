"""Spherical k-means token clusters: recovery, layout invariants, determinism, files."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.vocab.clusters import (
    Clusters,
    ClustersError,
    _lloyd_step,
    cluster_size_stats,
    head_fingerprint,
    load_clusters,
    save_clusters,
    spherical_kmeans,
)

GROUP_SIZES = (8, 16, 40, 100)  # deliberately unbalanced


def _grouped_head(seed: int = 0, d: int = 32, noise: float = 0.01):
    """Rows around a few random directions, with random norms (spherical k-means ignores them)
    and shuffled order; returns (w [V, d], true group of each row)."""
    rs = np.random.RandomState(seed)
    dirs = rs.randn(len(GROUP_SIZES), d)
    dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
    labels = np.concatenate([np.full(n, g) for g, n in enumerate(GROUP_SIZES)])
    w = dirs[labels] + noise * rs.randn(len(labels), d)
    w *= rs.uniform(0.2, 5.0, (len(labels), 1))
    order = rs.permutation(len(labels))
    return w[order].astype(np.float32), labels[order]


def _check_layout(c: Clusters) -> None:
    v, m = c.vocab_size, c.num_clusters
    assert c.assign.shape == (v,) and c.assign.dtype == np.int32
    assert c.perm.dtype == np.int32 and c.offsets.dtype == np.int32
    np.testing.assert_array_equal(np.sort(c.perm), np.arange(v))  # every token exactly once
    assert c.offsets.shape == (m + 1,) and c.offsets[0] == 0 and c.offsets[-1] == v
    np.testing.assert_array_equal(np.diff(c.offsets), c.sizes)
    np.testing.assert_array_equal(c.sizes, np.bincount(c.assign, minlength=m))
    for k in range(m):
        members = c.members(k)
        assert np.all(c.assign[members] == k) and np.all(np.diff(members) > 0)


@pytest.mark.parametrize("seed", [0, 1])
def test_kmeans_recovers_unbalanced_groups(seed):
    w, labels = _grouped_head(seed)
    c = spherical_kmeans(w, len(GROUP_SIZES), seed=seed, progress=False)
    _check_layout(c)
    # The same partition up to relabelling: each true group is exactly one cluster.
    pairs = set(zip(labels.tolist(), c.assign.tolist(), strict=True))
    assert len(pairs) == len(GROUP_SIZES), pairs
    assert sorted(c.sizes.tolist()) == sorted(GROUP_SIZES)
    st = cluster_size_stats(c)
    assert (st["min"], st["max"], st["singletons"], st["empty"]) == (8, 100, 0, 0)
    assert st["mean"] == pytest.approx(len(labels) / len(GROUP_SIZES))


def test_layout_and_determinism_on_random_rows():
    w = np.random.RandomState(3).randn(500, 16).astype(np.float32)
    a = spherical_kmeans(w, 20, seed=5, iters=10, batch=64, progress=False)  # 64 ∤ 500: padding
    b = spherical_kmeans(w, 20, seed=5, iters=10, batch=64, progress=False)
    _check_layout(a)
    np.testing.assert_array_equal(a.assign, b.assign)
    assert a.sizes.min() >= 1
    r = spherical_kmeans(w, 20, seed=5, iters=10, batch=64, init="random", progress=False)
    _check_layout(r)
    with pytest.raises(ClustersError, match="num_clusters"):
        spherical_kmeans(w, 501, progress=False)
    with pytest.raises(ClustersError, match="init"):
        spherical_kmeans(w, 4, init="bogus", progress=False)


def test_empty_cluster_is_reseeded_at_the_farthest_point():
    rs = np.random.RandomState(0)
    x = rs.randn(64, 8) + np.array([4.0] + [0] * 7)  # a cone around +e0
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    cents = np.stack([x[0], x[1], -np.eye(8)[0]])  # the third centroid is nobody's nearest
    far = int(np.argmin(np.max(x @ cents[:2].T, axis=1)))  # least served by its centroid
    cents = jnp.asarray(cents, jnp.float32)
    new, assign, best, reseeded = _lloyd_step(jnp.asarray(x, jnp.float32), jnp.ones(64, bool),
                                              cents, 3, 16)
    assert int(reseeded) == 1 and not np.any(np.asarray(assign) == 2)
    assert int(np.argmin(np.asarray(best))) == far
    np.testing.assert_allclose(np.asarray(new[2]), x[far], atol=1e-6)


def test_head_fingerprint_ignores_dtype_not_values():
    w = np.random.RandomState(0).randn(300, 8).astype(np.float32)
    fp = head_fingerprint(w)
    assert fp == head_fingerprint(jnp.asarray(w, jnp.bfloat16))
    w2 = w.copy()
    w2[-1] += 1.0  # the last row is always sampled
    assert head_fingerprint(w2) != fp
    assert head_fingerprint(w[:299]) != fp


def test_save_load_round_trip_and_refusals(tmp_path):
    w, _ = _grouped_head()
    c = spherical_kmeans(w, 4, progress=False)
    path = save_clusters(tmp_path / "c.npz", c, meta={"note": "test"})
    info = json.loads((tmp_path / "c.json").read_text())
    assert info["head_fingerprint"] == head_fingerprint(w) and info["meta"] == {"note": "test"}
    back = load_clusters(path, head_fingerprint=head_fingerprint(w))
    for k in ("assign", "perm", "offsets", "sizes"):
        np.testing.assert_array_equal(getattr(back, k), getattr(c, k))
    assert (back.vocab_size, back.num_clusters, back.head_fingerprint) == \
        (c.vocab_size, c.num_clusters, c.head_fingerprint)

    with pytest.raises(ClustersError, match="another LM head"):
        load_clusters(path, head_fingerprint=head_fingerprint(w + 1))
    with pytest.raises(ClustersError, match="no clusters file"):
        load_clusters(tmp_path / "missing.npz")
    with pytest.raises(ClustersError, match=r"\.npz"):
        save_clusters(tmp_path / "c.bin", c)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ClustersError, match="sha256"):
        load_clusters(path)
    path.write_bytes(raw)
    (tmp_path / "c.json").write_text("{not json")
    with pytest.raises(ClustersError, match="corrupt"):
        load_clusters(path)
