"""Maximum-inner-product search over the LM-head rows: EvoSpec's semantic recall, two ways.

EvoSpec retrieves the top-k LM-head rows for the target's hidden state with an HNSW index
(M = 32) built on *norm-augmented* rows: each row w gets one more coordinate
``sqrt(R^2 - |w|^2)`` (R the largest row norm) and the query gets 0, so that
``|q - w'|^2 = |q|^2 + R^2 - 2 q.w`` and the nearest neighbours in L2 are the largest inner
products. The index here is faiss's HNSW (``IndexHNSWFlat``, the same graph as hnswlib's;
faiss ships wheels, hnswlib only a source archive).

The exact path is a matmul and a top-k. When the query is the verification's final hidden
state, its exact top-k is the target's top-k logits, which verification has already
computed: specjax's EvoSpec head uses that (cost zero). :func:`compare` measures what the
approximate index gives up (recall@k) and what it costs per query.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np


def norm_augment(w: np.ndarray) -> np.ndarray:
    """Rows [V, d] -> [V, d + 1] whose L2 neighbours of ``[q, 0]`` are q's top inner products."""
    w = np.asarray(w, np.float32)
    sq = np.sum(w * w, axis=1)
    extra = np.sqrt(np.maximum(sq.max() - sq, 0.0))
    return np.concatenate([w, extra[:, None]], axis=1)


class HnswIndex:
    """An HNSW index over norm-augmented LM-head rows (faiss)."""

    def __init__(self, w: np.ndarray, *, m: int = 32, ef_construction: int = 40,
                 ef_search: int = 64):
        try:
            import faiss
        except ModuleNotFoundError:
            raise ModuleNotFoundError("the HNSW index needs faiss: pip install -e '.[evospec]' "
                                      "(faiss-cpu)") from None
        rows = norm_augment(w)
        self.dim = rows.shape[1]
        self.index = faiss.IndexHNSWFlat(self.dim, m)
        self.index.hnsw.efConstruction = ef_construction
        t0 = time.perf_counter()
        self.index.add(rows)
        self.build_s = time.perf_counter() - t0
        self.index.hnsw.efSearch = ef_search

    def search(self, queries: np.ndarray, k: int) -> np.ndarray:
        """[n, d] queries -> [n, k] int64 row ids, nearest (largest inner product) first."""
        q = np.asarray(queries, np.float32)
        q = np.concatenate([q, np.zeros((q.shape[0], 1), np.float32)], axis=1)
        return self.index.search(q, k)[1]


def exact_top_k(w: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """[n, k] the rows of largest inner product with each query, largest first."""
    scores = np.asarray(queries, np.float32) @ np.asarray(w, np.float32).T
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1, kind="stable")
    return np.take_along_axis(top, order, axis=1)


def recall_at_k(approx: np.ndarray, exact: np.ndarray) -> float:
    """Mean fraction of each exact top-k found in the approximate top-k."""
    return float(np.mean([len(set(a.tolist()) & set(e.tolist())) / len(e)
                          for a, e in zip(approx, exact, strict=True)]))


def compare(w: np.ndarray, queries: np.ndarray, *, k: int = 10, m: int = 32,
            ef_search: tuple[int, ...] = (16, 64, 256)) -> dict[str, Any]:
    """Recall@k and per-query latency (batch 1, host) of HNSW against the exact top-k."""
    index = HnswIndex(w, m=m)
    exact = exact_top_k(w, queries, k)

    def per_query_ms(fn) -> float:
        t0 = time.perf_counter()
        for q in queries:
            fn(q[None])
        return 1e3 * (time.perf_counter() - t0) / len(queries)

    out: dict[str, Any] = {"k": k, "m": m, "queries": int(len(queries)),
                           "rows": int(w.shape[0]), "build_s": index.build_s,
                           "exact_ms": per_query_ms(lambda q: exact_top_k(w, q, k)),
                           "hnsw": []}
    for ef in ef_search:
        index.index.hnsw.efSearch = ef
        approx = index.search(queries, k)
        out["hnsw"].append({"ef_search": ef, "recall": recall_at_k(approx, exact),
                            "ms": per_query_ms(lambda q: index.search(q, k))})
    return out
