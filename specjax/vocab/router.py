"""DynaSpec router (meta-classifier): [embedding(x_t); drafter hidden_{t-1}] -> M cluster logits.

The router scores the M token clusters (:mod:`specjax.vocab.clusters`) for the
next draft step from the same inputs the drafter's fc reads: the embedding of
the current token and the drafter's previous hidden state (DynaSpec section
4.2). The top-k clusters' members form that step's shortlist.

Architecture: an optional grouped RMSNorm on the input, then
``num_layers`` Linear layers with silu between them (2 = one hidden layer).
The norm matters: the two halves of the input are on very different scales
(on SmolLM2 the embedding rows have RMS ~0.13, the final-norm hidden states the
drafter imitates ~2), and without it the larger half dominates the first layer's
pre-activations and the optimiser must first undo that. ``norm_groups=2``
normalises each half separately, each with its own learned per-feature scale,
so the two start on an equal footing; a single norm over the concatenation
would leave their ratio unchanged.

Training uses the Flax NNX module :class:`Router`; inference uses the pure
:func:`router_logits` over the :class:`RouterParams` split out of it.

A router folder (written by :func:`save_router`)::

    OUT/
      params/          orbax flat {name: array}
      clusters.npz     the token clusters it scores (+ clusters.json)
      specjax.json     manifest (written last): config, the drafter's
                       fingerprint, the target's fields, metadata
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

from specjax import checkpoint as ckpt
from specjax import pytree
from specjax.drafter import DrafterParams
from specjax.vocab.clusters import (
    Clusters,
    ClustersError,
    hash_arrays,
    load_clusters,
    save_clusters,
)

FORMAT = "specjax-router"
CLUSTERS_FILE = "clusters.npz"
NORM_EPS = 1e-6
# Target fields a router depends on: clusters index the vocabulary, the input is 2 * width.
TARGET_FIELDS = ("model_type", "vocab_size", "hidden_size")
_FIX = "train a router for it with `specjax train router --drafter DRAFTER ...`"


class RouterMismatchError(ValueError):
    """The router was trained for another drafter or another target."""


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """Static router architecture."""

    in_dim: int  # 2 * d: [embedding(x_t); drafter hidden_{t-1}]
    num_clusters: int  # M, the logits
    hidden: int = 512  # width of the hidden layers
    num_layers: int = 2  # Linear layers; 2 = one hidden layer, 1 = a linear classifier
    # Input RMSNorm over this many equal slices of the input (2: embedding and hidden
    # state each normalised on their own); 0: no norm.
    norm_groups: int = 2

    def __post_init__(self):
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.norm_groups and self.in_dim % self.norm_groups:
            raise ValueError(f"in_dim {self.in_dim} is not divisible by norm_groups "
                             f"{self.norm_groups}")

    @property
    def dims(self) -> tuple[int, ...]:
        """Widths of the layer inputs and the output: (in_dim, hidden, ..., M)."""
        return (self.in_dim, *([self.hidden] * (self.num_layers - 1)), self.num_clusters)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> RouterConfig:
        return cls(**d)


@pytree.dataclass
class RouterParams:
    kernels: tuple[Array, ...]  # [dims[i], dims[i + 1]] per layer
    biases: tuple[Array, ...]  # [dims[i + 1]] per layer
    norm_scale: Array | None = None  # [G, in_dim // G]; None: no input norm


def router_logits(params: RouterParams, x: Array) -> Array:
    """Cluster logits.

    Args:
      x: [..., in_dim] router inputs (any float dtype; computed in the params' dtype).
    Returns:
      [..., M] logits; sigmoid(logit) is the probability that the cluster holds
      one of the full-vocabulary drafter's top-L tokens.
    """
    dtype = params.kernels[0].dtype
    x = x.astype(dtype)
    if params.norm_scale is not None:
        g, w = params.norm_scale.shape
        xs = x.reshape(*x.shape[:-1], g, w)
        xf = xs.astype(jnp.float32)
        xs = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + NORM_EPS)).astype(dtype)
        x = (xs * params.norm_scale).reshape(x.shape)
    n = len(params.kernels)
    for i, (k, b) in enumerate(zip(params.kernels, params.biases, strict=True)):
        x = x @ k + b
        if i < n - 1:
            x = jax.nn.silu(x)
    return x


class Router(nnx.Module):
    """Trainable router. ``params()`` gives the pytree :func:`router_logits` takes."""

    def __init__(self, cfg: RouterConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        g = cfg.norm_groups
        self.norm_scale = nnx.Param(jnp.ones((g, cfg.in_dim // g))) if g else None
        dims = cfg.dims
        self.layers = nnx.List([nnx.Linear(dims[i], dims[i + 1], rngs=rngs)
                                for i in range(cfg.num_layers)])

    def params(self) -> RouterParams:
        return RouterParams(kernels=tuple(lin.kernel[...] for lin in self.layers),
                            biases=tuple(lin.bias[...] for lin in self.layers),
                            norm_scale=None if self.norm_scale is None else self.norm_scale[...])

    def __call__(self, x: Array) -> Array:
        """[..., in_dim] -> [..., M] logits."""
        return router_logits(self.params(), x)


def fingerprint(tree: Any) -> str:
    """sha256 of a pytree's leaves (paths, shapes, values rounded to bfloat16), in tree order.

    Used to tie a router to the drafter whose hidden states it reads: the same
    drafter loaded in float32 or bfloat16 hashes alike (see
    :func:`specjax.vocab.clusters.hash_arrays`), any retrained one differs.
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    names = [jax.tree_util.keystr(p) for p, _ in leaves]
    if isinstance(tree, DrafterParams):
        # A drafter's first layer hashes under its path from before deeper drafters
        # (".layer.wq", not ".layers[0].wq"), so the routers trained for one-layer drafters
        # stay tied to them.
        names = [re.sub(r"^\.layers\[0\]\.", ".layer.", n) for n in names]
    return hash_arrays(zip(names, (leaf for _, leaf in leaves), strict=True))


def target_fields_of(cfg: Any, clusters: Clusters | None = None) -> dict[str, Any]:
    """The target fields a router is tied to, from a :class:`~specjax.config.ModelConfig`.

    With ``clusters``, also the fingerprint of the head they were computed from,
    so a same-shaped but different target (another fine-tune) is refused too.
    """
    out = {f: getattr(cfg, f) for f in TARGET_FIELDS}
    if clusters is not None and clusters.head_fingerprint:
        out["head_fingerprint"] = clusters.head_fingerprint
    return out


def _flatten(params: RouterParams) -> dict[str, Array]:
    flat = {f"kernel.{i}": k for i, k in enumerate(params.kernels)}
    flat |= {f"bias.{i}": b for i, b in enumerate(params.biases)}
    if params.norm_scale is not None:
        flat["norm_scale"] = params.norm_scale
    return flat


def save_router(path: Path, params: RouterParams, cfg: RouterConfig, clusters: Clusters, *,
                drafter_fingerprint: str, target_fields: dict[str, Any],
                extra: dict | None = None, overwrite: bool = False) -> Path:
    """Write a router folder atomically: params, clusters, then the manifest.

    Args:
      drafter_fingerprint: :func:`fingerprint` of the drafter params whose hidden
        states the router was trained on.
      target_fields: e.g. :func:`target_fields_of` the target (vocab_size and
        hidden_size at least); :func:`load_router` compares them.
      extra: free-form metadata stored under the manifest's ``meta``.
    """
    if clusters.num_clusters != cfg.num_clusters:
        raise ValueError(f"the router has {cfg.num_clusters} outputs but the clusters are "
                         f"{clusters.num_clusters}")
    missing = [f for f in ("vocab_size", "hidden_size") if f not in target_fields]
    if missing:
        raise ValueError(f"target_fields lacks {missing}; pass target_fields_of(target.cfg)")
    if target_fields["vocab_size"] != clusters.vocab_size:
        raise ValueError(f"the clusters cover {clusters.vocab_size} tokens but the target has "
                         f"{target_fields['vocab_size']}")

    def build(tmp: Path) -> None:
        save_clusters(tmp / CLUSTERS_FILE, clusters)
        ckpt.save_tree(tmp, _flatten(params), FORMAT, cfg.to_json(),
                       drafter_fingerprint=drafter_fingerprint, target=dict(target_fields),
                       meta=extra or {})

    return ckpt.write_atomically(Path(path), build, overwrite=overwrite)


def _read_manifest(path: Path) -> dict[str, Any]:
    fix = "train it again with `specjax train router`"
    if not path.is_dir():
        raise ckpt.CheckpointError(f"{path}: no such router folder; train one with "
                                   "`specjax train router --out DIR`")
    mpath = path / ckpt.MANIFEST
    if not mpath.exists():
        raise ckpt.CheckpointError(f"{path}: not a router folder (no {ckpt.MANIFEST}); it may "
                                   f"be an interrupted save: {fix}")
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise ckpt.CheckpointError(f"{mpath} is corrupt ({e}); {fix}") from e
    if manifest.get("format") != FORMAT or manifest.get("version") != ckpt.VERSION:
        raise ckpt.CheckpointError(
            f"{path}: format {manifest.get('format')!r} v{manifest.get('version')}, expected "
            f"{FORMAT!r} v{ckpt.VERSION} (is this a drafter or target folder?); {fix}")
    return manifest


def load_router(path: Path, *, drafter_fingerprint: str, target_fields: dict[str, Any],
                dtype: str | None = None) -> tuple[RouterConfig, RouterParams, Clusters, dict]:
    """(config, params, clusters, meta) of a router folder, checked against its drafter and target.

    Raises:
      RouterMismatchError: trained for another drafter, or for a target whose
        fields (vocab_size, hidden_size, ...) differ from ``target_fields``.
      CheckpointError / ClustersError: the folder is missing or corrupt.
    """
    path = Path(path)
    manifest = _read_manifest(path)
    stored = manifest.get("target", {})
    bad = [f"{k}: router {stored[k]!r} vs target {v!r}"
           for k, v in target_fields.items() if k in stored and stored[k] != v]
    if bad:
        raise RouterMismatchError(f"{path} was trained for a different target ({'; '.join(bad)}"
                                  f"); {_FIX}")
    if manifest.get("drafter_fingerprint") != drafter_fingerprint:
        raise RouterMismatchError(
            f"{path} was trained on another drafter's hidden states (drafter_fingerprint "
            f"{str(manifest.get('drafter_fingerprint'))[:12]} vs this drafter's "
            f"{drafter_fingerprint[:12]}); {_FIX}")
    cfg = RouterConfig.from_json(manifest["config"])
    try:
        clusters = load_clusters(path / CLUSTERS_FILE)
    except ClustersError as e:
        raise ckpt.CheckpointError(f"{path}: bad clusters ({e}); train the router again with "
                                   "`specjax train router`") from e
    if clusters.num_clusters != cfg.num_clusters:
        raise ckpt.CheckpointError(f"{path}: {cfg.num_clusters} router outputs but "
                                   f"{clusters.num_clusters} clusters; the folder is corrupt")
    try:
        flat = ckpt.restore_params(path, manifest)
    except ckpt.CheckpointError as e:
        raise ckpt.CheckpointError(f"{path}: cannot restore the router's tensors; train it "
                                   f"again with `specjax train router` ({e})") from e
    if dtype is not None:
        flat = {k: v.astype(jnp.dtype(dtype)) for k, v in flat.items()}
    params = RouterParams(kernels=tuple(flat[f"kernel.{i}"] for i in range(cfg.num_layers)),
                          biases=tuple(flat[f"bias.{i}"] for i in range(cfg.num_layers)),
                          norm_scale=flat.get("norm_scale"))
    if params.kernels[0].shape[0] != cfg.in_dim:
        raise ckpt.CheckpointError(f"{path}: first kernel {params.kernels[0].shape} does not "
                                   f"match in_dim {cfg.in_dim}; the folder is corrupt")
    return cfg, params, clusters, manifest.get("meta", {})

