"""MIPS over LM-head rows: norm augmentation, the HNSW index against the exact top-k."""

from __future__ import annotations

import numpy as np
import pytest

from specjax.vocab.mips import compare, exact_top_k, norm_augment, recall_at_k


def test_norm_augmentation_turns_inner_products_into_distances():
    rs = np.random.RandomState(0)
    w = rs.randn(50, 8).astype(np.float32) * rs.rand(50, 1).astype(np.float32)
    q = rs.randn(8).astype(np.float32)
    aug = norm_augment(w)
    d2 = np.sum((np.append(q, 0.0) - aug) ** 2, axis=1)
    assert np.argsort(d2)[:5].tolist() == np.argsort(-(w @ q))[:5].tolist()
    assert np.allclose(np.linalg.norm(aug, axis=1), np.linalg.norm(aug, axis=1).max())


def test_hnsw_recall_on_random_rows():
    pytest.importorskip("faiss")
    rs = np.random.RandomState(1)
    w = rs.randn(2000, 16).astype(np.float32)
    qs = rs.randn(50, 16).astype(np.float32)
    r = compare(w, qs, k=10, m=32, ef_search=(8, 128))
    assert r["hnsw"][1]["recall"] >= 0.95 and r["hnsw"][1]["recall"] >= r["hnsw"][0]["recall"]
    assert recall_at_k(exact_top_k(w, qs, 10), exact_top_k(w, qs, 10)) == 1.0
