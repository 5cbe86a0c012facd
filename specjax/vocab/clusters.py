"""DynaSpec token clusters: unbalanced spherical k-means over the LM-head rows.

DynaSpec (section 4.2) partitions the vocabulary into M coarse clusters by
spherical k-means on the column-normalised LM-head weights ``W_LM[:, v] /
||W_LM[:, v]||``. Our head is stored ``[V, d]`` (a token is a row), so that is
k-means over the row-normalised head: token v's point is ``w[v] / ||w[v]||``
on the unit sphere, similarity is the cosine, and a centroid is the
normalised mean of its members. Balance is *not* enforced: cluster sizes may
vary widely, which the paper finds preserves recall in semantically dense
regions.

A :class:`Clusters` stores the partition in the form the shortlist head
gathers from: ``perm`` lists the token ids cluster by cluster, and cluster m's
members are ``perm[offsets[m]:offsets[m + 1]]``.

Files: :func:`save_clusters` writes ``NAME.npz`` (the arrays) and then
``NAME.json`` (metadata, written last and atomically, holding the npz's sha256
and the fingerprint of the head the clusters were computed from, see
:func:`head_fingerprint`), so a ``.json`` that exists describes a complete npz.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from specjax import pytree
from specjax.vocab._files import file_sha256

FORMAT = "specjax-clusters"
VERSION = 1
# Rows of the head sampled by head_fingerprint (first, last and evenly spaced between).
FINGERPRINT_ROWS = 64
# k-means++ seeds from a subsample of max(init_sample * M, this) rows (all rows if fewer).
INIT_MIN_SAMPLE = 4096


class ClustersError(ValueError):
    """A clusters file is missing, corrupt, or was computed from another head."""


# --------------------------------------------------------------------------- the partition


@pytree.dataclass
class Clusters:
    """A partition of the vocabulary into ``num_clusters`` clusters (numpy arrays).

    A pytree: the four arrays are children, the sizes and the fingerprint static.
    """

    assign: np.ndarray  # [V] int32: the cluster of each token
    perm: np.ndarray  # [V] int32: token ids sorted by cluster (ascending id within one)
    offsets: np.ndarray  # [M + 1] int32: cluster m is perm[offsets[m]:offsets[m + 1]]
    sizes: np.ndarray  # [M] int32: members per cluster (0 only if the head has < M
    #                    distinct directions)
    vocab_size: int = pytree.static_field()
    num_clusters: int = pytree.static_field()
    # head_fingerprint(w) of the head clustered; "" if unknown
    head_fingerprint: str = pytree.static_field(default="")

    @classmethod
    def from_assign(cls, assign: np.ndarray | Array, num_clusters: int,
                    head_fingerprint: str = "") -> Clusters:
        """Build perm / offsets / sizes from a [V] cluster index per token."""
        assign = np.asarray(assign).astype(np.int32)
        if assign.ndim != 1 or assign.size == 0:
            raise ClustersError(f"assign must be a non-empty [V] vector, got shape "
                                f"{assign.shape}")
        if assign.min() < 0 or assign.max() >= num_clusters:
            raise ClustersError(f"assign has cluster ids outside [0, {num_clusters}): "
                                f"min {assign.min()}, max {assign.max()}")
        sizes = np.bincount(assign, minlength=num_clusters).astype(np.int32)
        # Stable: members of a cluster stay in ascending token-id order.
        perm = np.argsort(assign, kind="stable").astype(np.int32)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
        return cls(assign=assign, perm=perm, offsets=offsets, sizes=sizes,
                   vocab_size=int(assign.size), num_clusters=int(num_clusters),
                   head_fingerprint=head_fingerprint)

    def members(self, m: int) -> np.ndarray:
        """Token ids of cluster ``m`` (ascending)."""
        return self.perm[self.offsets[m]:self.offsets[m + 1]]

    def shortlist(self, chosen: Iterable[int]) -> np.ndarray:
        """Token ids of the union of the ``chosen`` clusters, cluster by cluster."""
        return np.concatenate([self.members(int(m)) for m in chosen] or
                              [np.zeros((0,), np.int32)])


def cluster_size_stats(clusters: Clusters) -> dict[str, Any]:
    """Cluster-size summary for reports: min / percentiles / mean / max, singletons, empties."""
    s = np.asarray(clusters.sizes)
    pct = {f"p{q}": float(np.percentile(s, q)) for q in (10, 25, 75, 90, 99)}
    return {"vocab_size": clusters.vocab_size, "num_clusters": clusters.num_clusters,
            "min": int(s.min()), "median": float(np.median(s)), "mean": float(s.mean()),
            "max": int(s.max()), **pct, "singletons": int(np.sum(s == 1)),
            "empty": int(np.sum(s == 0)),
            "largest_fraction": float(s.max() / max(clusters.vocab_size, 1))}


# --------------------------------------------------------------------------- fingerprints


def hash_arrays(named: Iterable[tuple[str, Any]]) -> str:
    """sha256 over (name, shape, values) of each array, in the given order.

    Floating values are rounded to bfloat16 before hashing so that the same
    weights loaded as float32 or as bfloat16 (``specjax.load(..., dtype=...)``)
    hash alike; weights that differ by more than bf16 rounding (another
    checkpoint, a retrained drafter) still differ. Integer arrays are hashed
    exactly (as int64).
    """
    h = hashlib.sha256()
    for name, a in named:
        if jnp.issubdtype(a.dtype, jnp.floating):
            a = np.asarray(jnp.asarray(a).astype(jnp.bfloat16))
        else:
            a = np.asarray(a).astype(np.int64)
        h.update(f"{name}:{list(a.shape)};".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def head_fingerprint(w: Array | np.ndarray) -> str:
    """Cheap fingerprint of a [V, d] head: its shape and a fixed sample of its rows.

    The sample is the first and last rows and evenly spaced rows between
    (``FINGERPRINT_ROWS`` in all), hashed with :func:`hash_arrays` (so float32
    and bfloat16 loads of one head agree). Hashing all V*d values would cost
    a second on the real head for no practical gain: two different heads of
    one shape do not share these rows.
    """
    v = int(w.shape[0])
    rows = np.unique(np.linspace(0, v - 1, min(FINGERPRINT_ROWS, v)).round().astype(np.int64))
    return hash_arrays([(f"head{list(w.shape)}", jnp.asarray(w)[jnp.asarray(rows)])])


# --------------------------------------------------------------------------- k-means


def _normalize(x: Array) -> Array:
    # eps: an all-zero row (an unused token) stays zero instead of becoming NaN.
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


@partial(jax.jit, static_argnames=("batch",))
def _assign(x: Array, centroids: Array, batch: int) -> tuple[Array, Array]:
    """Nearest centroid by cosine, in row chunks so the [V, M] similarity never exists whole.

    Args:
      x: [Vp, d] unit rows, Vp a multiple of ``batch``; centroids: [M, d] unit rows.
    Returns:
      (assign [Vp] int32, best cosine [Vp]).
    """
    chunks = x.reshape(-1, batch, x.shape[-1])

    def one(c):
        sims = c @ centroids.T  # [batch, M]
        return jnp.argmax(sims, -1).astype(jnp.int32), jnp.max(sims, -1)

    a, s = jax.lax.map(one, chunks)
    return a.reshape(-1), s.reshape(-1)


@partial(jax.jit, static_argnames=("num_clusters", "batch"))
def _lloyd_step(x: Array, valid: Array, centroids: Array, num_clusters: int,
                batch: int) -> tuple[Array, Array, Array, Array]:
    """One spherical Lloyd iteration: assign, then move each centroid to its normalised mean.

    A cluster that ends up empty is re-seeded at one of the points farthest from
    their own centroid (lowest best-cosine), a different point per empty cluster,
    so it takes over the worst-served region instead of staying dead.

    Returns:
      (new centroids [M, d], assign [Vp] from the *old* centroids, best cosine
      [Vp], number of re-seeded clusters).
    """
    assign, best = _assign(x, centroids, batch)
    seg = jnp.where(valid, assign, num_clusters)  # padding rows go to a dropped segment
    sums = jax.ops.segment_sum(x, seg, num_clusters + 1)[:num_clusters]
    counts = jax.ops.segment_sum(valid.astype(jnp.int32), seg, num_clusters + 1)[:num_clusters]
    empty = counts == 0
    # The k-th empty cluster takes the k-th farthest point (k < M, so top_k over M suffices).
    far = jax.lax.top_k(jnp.where(valid, -best, -jnp.inf), num_clusters)[1]
    rank = jnp.cumsum(empty) - 1
    reseed = x[far[jnp.clip(rank, 0, num_clusters - 1)]]
    new = jnp.where(empty[:, None], reseed, _normalize(sums))
    return new, assign, best, jnp.sum(empty)


@partial(jax.jit, static_argnames=("num_clusters",))
def _kmeanspp(x: Array, key: Array, num_clusters: int) -> Array:
    """k-means++ seeding on the sphere over the rows of ``x`` [n, d] -> [M, d] centroids.

    For unit vectors ||a - b||^2 = 2 (1 - cos), so the D^2 weight is 1 - (the
    best cosine to any chosen centre).
    """
    n = x.shape[0]
    k0, key = jax.random.split(key)
    first = jax.random.randint(k0, (), 0, n)
    cents = jnp.zeros((num_clusters, x.shape[1]), x.dtype).at[0].set(x[first])
    best = x @ x[first]

    def body(i, carry):
        cents, best, key = carry
        key, sub = jax.random.split(key)
        w = jnp.maximum(1.0 - best, 0.0)
        # All remaining points coincide with a centre: fall back to uniform.
        logits = jnp.where(jnp.sum(w) > 0, jnp.log(w + 1e-30), jnp.zeros_like(w))
        j = jax.random.categorical(sub, logits)
        cents = cents.at[i].set(x[j])
        return cents, jnp.maximum(best, x @ x[j]), key

    cents, _, _ = jax.lax.fori_loop(1, num_clusters, body, (cents, best, key))
    return cents


INIT_MODES = ("kmeans++", "random")


def spherical_kmeans(w: Array | np.ndarray, num_clusters: int, *, iters: int = 25,
                     seed: int = 0, batch: int = 4096, init: str = "kmeans++",
                     init_sample: int = 8, progress: bool = True) -> Clusters:
    """Unbalanced spherical k-means over the rows of an LM head.

    Args:
      w: [V, d] the LM head (a token per row); rows are normalised here.
      num_clusters: M, 1 <= M <= V.
      iters: at most this many Lloyd iterations; stops early once no token
        changes cluster.
      seed: the init's randomness; same (w, M, settings, seed) -> same clusters.
      batch: rows per chunk of the [chunk, M] similarity matmul (memory bound
        is batch * M floats, not V * M).
      init: ``"kmeans++"`` (default): D^2 seeding on a random subsample of
        ``max(init_sample * M, INIT_MIN_SAMPLE)`` rows (all rows of a smaller
        head); the subsample keeps the M sequential seeding passes cheap (each
        reads the whole subsample: ~1 s for M = 1024 on SmolLM2) while still
        spreading the seeds over the sphere, which leaves far fewer near-empty
        and duplicated clusters than ``"random"``: M distinct random rows.
      progress: tqdm bar over the iterations (mean best cosine, tokens moved).
    Returns:
      :class:`Clusters` with ``head_fingerprint`` set from ``w``.
    """
    from tqdm.auto import tqdm

    v, d = w.shape
    if not 1 <= num_clusters <= v:
        raise ClustersError(f"num_clusters must be in [1, V={v}], got {num_clusters}")
    if init not in INIT_MODES:
        raise ClustersError(f"init must be one of {INIT_MODES}, not {init!r}")
    x = _normalize(jnp.asarray(w, jnp.float32))
    batch = max(1, min(batch, v))
    pad = -v % batch
    xp = jnp.pad(x, ((0, pad), (0, 0)))
    valid = jnp.arange(v + pad) < v

    t0 = time.time()
    key = jax.random.PRNGKey(seed)
    k_sub, k_init = jax.random.split(key)
    if init == "kmeans++":
        n = min(v, max(init_sample * num_clusters, INIT_MIN_SAMPLE))
        sub = jax.random.choice(k_sub, v, (n,), replace=False)
        cents = _kmeanspp(x[sub], k_init, num_clusters)
    else:
        cents = x[jax.random.choice(k_init, v, (num_clusters,), replace=False)]

    prev = None
    bar = tqdm(range(iters), desc=f"spherical k-means (M={num_clusters})", unit="it",
               disable=not progress, dynamic_ncols=True)
    for _ in bar:
        cents, assign, best, reseeded = _lloyd_step(xp, valid, cents, num_clusters, batch)
        moved = v if prev is None else int(jnp.sum((assign != prev)[:v]))
        bar.set_postfix(cos=f"{float(jnp.mean(best[:v])):.4f}", moved=moved,
                        reseeded=int(reseeded))
        if moved == 0 and int(reseeded) == 0:
            break  # assignments are a fixed point: the centroids will not move again
        prev = assign
    bar.close()
    assign, best = _assign(xp, cents, batch)  # consistent with the final centroids
    out = Clusters.from_assign(np.asarray(assign[:v]), num_clusters, head_fingerprint(w))
    if progress:
        st = cluster_size_stats(out)
        bar.write(f"clusters: M={num_clusters}, sizes min {st['min']} median {st['median']:.0f} "
                  f"max {st['max']}, {st['singletons']} singletons, mean cosine "
                  f"{float(jnp.mean(best[:v])):.4f} [{time.time() - t0:.1f}s]")
    return out


# --------------------------------------------------------------------------- files


def _meta_path(path: Path) -> Path:
    return Path(path).with_suffix(".json")


def save_clusters(path: Path, clusters: Clusters, meta: dict | None = None) -> Path:
    """Write ``path`` (``.npz``: assign, perm, offsets, sizes) and then its ``.json`` metadata.

    Both are written under temporary names and renamed into place, the JSON
    last, so a present JSON always describes a complete npz (it records the
    npz's sha256).
    """
    path = Path(path)
    if path.suffix != ".npz":
        raise ClustersError(f"{path}: a clusters file must end in .npz")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.stem}.{uuid.uuid4().hex[:8]}.tmp.npz"
    np.savez(tmp, assign=clusters.assign, perm=clusters.perm, offsets=clusters.offsets,
             sizes=clusters.sizes)
    os.replace(tmp, path)
    info = {"format": FORMAT, "version": VERSION, "vocab_size": clusters.vocab_size,
            "num_clusters": clusters.num_clusters,
            "head_fingerprint": clusters.head_fingerprint,
            "head_fingerprint_method": f"sha256 of the head's shape and {FINGERPRINT_ROWS} "
                                       "evenly spaced rows (first and last included), rounded "
                                       "to bfloat16",
            "npz_sha256": file_sha256(path), "sizes": cluster_size_stats(clusters),
            "meta": meta or {}}
    mtmp = path.parent / f".{path.stem}.{uuid.uuid4().hex[:8]}.tmp.json"
    mtmp.write_text(json.dumps(info, indent=1))
    os.replace(mtmp, _meta_path(path))
    return path


def load_clusters(path: Path, *, head_fingerprint: str | None = None) -> Clusters:
    """Read a clusters file written by :func:`save_clusters`, checking it is whole.

    Args:
      head_fingerprint: when given, refuse clusters computed from another head.
    """
    path = Path(path)
    mpath = _meta_path(path)
    fix = "compute them again (`specjax train router --clusters M` without --clusters-file)"
    if not path.is_file() or not mpath.is_file():
        raise ClustersError(f"{path}: no clusters file (needs {path.name} and {mpath.name}); "
                            f"{fix}")
    try:
        info = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise ClustersError(f"{mpath} is corrupt ({e}); {fix}") from e
    if info.get("format") != FORMAT or info.get("version") != VERSION:
        raise ClustersError(f"{mpath}: format {info.get('format')!r} v{info.get('version')}, "
                            f"expected {FORMAT!r} v{VERSION}; {fix}")
    if file_sha256(path) != info["npz_sha256"]:
        raise ClustersError(f"{path} does not match its {mpath.name} (sha256 differs: corrupt "
                            f"or replaced); {fix}")
    if head_fingerprint is not None and info["head_fingerprint"] != head_fingerprint:
        raise ClustersError(f"{path} was computed from another LM head (head fingerprint "
                            f"{info['head_fingerprint'][:12]} vs this target's "
                            f"{head_fingerprint[:12]}); {fix}")
    with np.load(path) as z:
        out = Clusters.from_assign(z["assign"], info["num_clusters"], info["head_fingerprint"])
        for k in ("perm", "offsets", "sizes"):
            if not np.array_equal(z[k], getattr(out, k)):
                raise ClustersError(f"{path}: stored {k} is inconsistent with assign; {fix}")
    if out.vocab_size != info["vocab_size"]:
        raise ClustersError(f"{path}: {out.vocab_size} tokens, metadata says "
                            f"{info['vocab_size']}; {fix}")
    return out
