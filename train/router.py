"""DynaSpec router training: multi-label BCE over token clusters, with optax.

For every draft step the collector records the router's input and the
full-vocabulary drafter's top-L tokens there; a cluster's label is 1 iff it
holds at least one of them (DynaSpec eq. in section 4.2)::

    y_m = 1[C_m ∩ top-L ≠ ∅],   loss = E[ Σ_m BCE(σ(s_m), y_m) ]

The labels are computed on the fly from ``clusters.assign``, so one data set
serves any clustering.

Data directory (written by the collector through :func:`write_router_shard`
and :func:`write_router_meta`)::

    DATA/
      meta.json          {"in_dim", "top_l", "vocab_size", "drafter_fingerprint",
                          "num_records", ...}
      shard_00000.npz    x    [n, in_dim] float16  router input [embedding(x_t); hidden_{t-1}]
      shard_00001.npz    topl [n, L] int32         the drafter's top-L ids, most probable first
      ...                step [n] int32            draft position t (0 = first drafted token)

As in drafter training, the NNX :class:`~specjax.vocab.router.Router` is split
into ``(graphdef, params)`` at the jit boundary, and the orbax checkpoints hold
exactly the plain pytrees the jitted step takes.

What tells whether a router is good is not the BCE but the held-out
**recall@k**: the fraction of the drafter's top-L tokens that fall in the union
of the router's top-k clusters, next to the **shortlist size** (the tokens in
those clusters) it costs. Both are reported for a few k, per draft step, and for
the static baseline that always picks the k clusters most often positive in
training (a frequency-ranked shortlist at cluster granularity, FR-Spec-like).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax import Array

from specjax.checkpoint import write_json_atomic
from specjax.train.drafter import ckpt_manager
from specjax.vocab.clusters import Clusters, cluster_size_stats, hash_arrays
from specjax.vocab.router import (
    Router,
    RouterConfig,
    RouterMismatchError,
    load_router,
    router_logits,
    save_router,
)

META_FILE = "meta.json"
SHARD_PREFIX = "shard_"
LOG_FILE = "training_log.json"
METRICS_FILE = "metrics.json"
PLOT_FILE = "loss.png"
# Held-out recall is also reported per draft step t = 0 .. STEP_BUCKETS - 2, and for
# t >= STEP_BUCKETS - 1 together: what the position-aware budget k_c(t) is chosen from.
STEP_BUCKETS = 8
# Clamp of the per-cluster prior used to initialise the output bias (a cluster never
# positive in training would otherwise start at -inf).
PRIOR_CLIP = 1e-4


# --------------------------------------------------------------------------- data


def _shard_path(dir_: Path, idx: int) -> Path:
    return Path(dir_) / f"{SHARD_PREFIX}{idx:05d}.npz"


def write_router_shard(dir_: Path, idx: int, x: np.ndarray | Array, topl: np.ndarray | Array,
                       step: np.ndarray | Array) -> Path:
    """Write one training shard (atomically: temp file, then rename).

    Args:
      idx: shard number; shards must be numbered 0, 1, 2, ... without gaps.
      x: [n, in_dim] router inputs, stored as float16.
      topl: [n, L] the full-vocabulary drafter's top-L token ids, most probable first.
      step: [n] draft position t of each record (0 = first drafted token).
    """
    x, topl, step = np.asarray(x), np.asarray(topl), np.asarray(step)
    n = len(x)
    if x.ndim != 2 or topl.ndim != 2 or step.shape != (n,) or len(topl) != n:
        raise ValueError(f"shard {idx}: expected x [n, in_dim], topl [n, L], step [n] with one "
                         f"n, got {x.shape}, {topl.shape}, {step.shape}")
    dir_ = Path(dir_)
    dir_.mkdir(parents=True, exist_ok=True)
    out = _shard_path(dir_, idx)
    tmp = dir_ / f".{out.stem}.{uuid.uuid4().hex[:8]}.tmp.npz"
    np.savez(tmp, x=x.astype(np.float16), topl=topl.astype(np.int32),
             step=step.astype(np.int32))
    os.replace(tmp, out)
    return out


def write_router_meta(dir_: Path, *, in_dim: int, top_l: int, vocab_size: int,
                      drafter_fingerprint: str, num_records: int,
                      extra: dict | None = None) -> Path:
    """Write ``meta.json`` (last, once every shard is written) for :func:`read_router_data`."""
    meta = {"in_dim": int(in_dim), "top_l": int(top_l), "vocab_size": int(vocab_size),
            "drafter_fingerprint": drafter_fingerprint, "num_records": int(num_records),
            **(extra or {})}
    dir_ = Path(dir_)
    dir_.mkdir(parents=True, exist_ok=True)
    write_json_atomic(dir_ / META_FILE, meta)
    return dir_ / META_FILE


@dataclasses.dataclass(frozen=True)
class RouterData:
    """Router training records, in collection order (host numpy arrays)."""

    x: np.ndarray  # [N, in_dim] float16
    topl: np.ndarray  # [N, L] int32
    step: np.ndarray  # [N] int32
    meta: dict

    def __len__(self) -> int:
        return len(self.x)

    def rows(self, sl: slice | np.ndarray) -> RouterData:
        return RouterData(x=self.x[sl], topl=self.topl[sl], step=self.step[sl], meta=self.meta)


_DATA_FIX = "collect the router data again (`specjax train router --collect ...`)"


def read_router_meta(dir_: Path) -> dict[str, Any]:
    """The ``meta.json`` of a router data directory, checked for the required fields."""
    dir_ = Path(dir_)
    if not (dir_ / META_FILE).is_file():
        raise FileNotFoundError(f"{dir_}: no router data ({META_FILE} missing; an interrupted "
                                f"collection writes it last); {_DATA_FIX}")
    try:
        meta = json.loads((dir_ / META_FILE).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{dir_ / META_FILE} is corrupt ({e}); {_DATA_FIX}") from e
    missing = [k for k in ("in_dim", "top_l", "vocab_size", "drafter_fingerprint",
                           "num_records") if k not in meta]
    if missing:
        raise ValueError(f"{dir_ / META_FILE} lacks {missing}; {_DATA_FIX}")
    return meta


def read_router_data(dir_: Path) -> RouterData:
    """Read a router data directory whole into memory, checking it against ``meta.json``.

    Memory: N * (2 * in_dim + 4 * (L + 1)) bytes, ~0.5 GB for 200k records of
    SmolLM2 (in_dim 1152) with L = 8.
    """
    dir_ = Path(dir_)
    fix = _DATA_FIX
    meta = read_router_meta(dir_)
    names = sorted(p.name for p in dir_.glob(f"{SHARD_PREFIX}*.npz"))
    expected = [_shard_path(dir_, i).name for i in range(len(names))]
    if not names or names != expected:
        raise ValueError(f"{dir_}: shards must be {SHARD_PREFIX}00000.npz, "
                         f"{SHARD_PREFIX}00001.npz, ... without gaps; found "
                         f"{names[:3]}{'...' if len(names) > 3 else ''}; {fix}")
    xs, ts, ss = [], [], []
    for name in names:
        try:
            with np.load(dir_ / name) as z:
                x, topl, step = z["x"], z["topl"], z["step"]
        except Exception as e:  # zipfile / pickle / key errors all mean a broken shard
            raise ValueError(f"{dir_ / name} is unreadable ({type(e).__name__}: {e}); "
                             f"{fix}") from e
        if x.shape[1:] != (meta["in_dim"],) or topl.shape[1:] != (meta["top_l"],) \
                or len(topl) != len(x) or step.shape != (len(x),):
            raise ValueError(f"{dir_ / name}: x {x.shape}, topl {topl.shape}, step "
                             f"{step.shape} do not match meta in_dim {meta['in_dim']}, top_l "
                             f"{meta['top_l']}; {fix}")
        xs.append(x)
        ts.append(topl)
        ss.append(step)
    data = RouterData(x=np.concatenate(xs), topl=np.concatenate(ts).astype(np.int32),
                      step=np.concatenate(ss).astype(np.int32), meta=meta)
    if len(data) != meta["num_records"]:
        raise ValueError(f"{dir_}: {len(data)} records in the shards but meta.json says "
                         f"{meta['num_records']}; {fix}")
    if len(data) and (data.topl.min() < 0 or data.topl.max() >= meta["vocab_size"]):
        raise ValueError(f"{dir_}: topl has ids outside [0, {meta['vocab_size']}); {fix}")
    return data


def cluster_labels(topl: Array, assign: Array, num_clusters: int) -> Array:
    """[B, L] token ids -> [B, M] float 0/1: does cluster m hold one of the row's tokens."""
    b = topl.shape[0]
    c = assign[topl]
    return jnp.zeros((b, num_clusters), jnp.float32).at[jnp.arange(b)[:, None], c].set(1.0)


def cluster_prior(topl: np.ndarray, assign: np.ndarray, num_clusters: int) -> np.ndarray:
    """[M] fraction of records in which each cluster is positive (numpy, chunk-free)."""
    n = len(topl)
    if n == 0:
        return np.zeros((num_clusters,))
    c = assign[topl].astype(np.int64) + num_clusters * np.arange(n)[:, None]
    return np.bincount(np.unique(c) % num_clusters, minlength=num_clusters) / n


# --------------------------------------------------------------------------- config, steps


@dataclasses.dataclass(frozen=True)
class RouterTrainConfig:
    """Hyper-parameters; frozen so they can be stored and compared on resume."""

    steps: int | None = None  # total optimizer steps; None -> epochs * batches per epoch
    epochs: float = 2.0
    batch: int = 256  # records per step
    lr: float = 1e-3
    warmup_fraction: float = 0.05
    final_lr_fraction: float = 0.1  # cosine decays to lr * this
    weight_decay: float = 0.01  # on kernels only, not on biases or the norm scale
    grad_clip: float = 1.0
    heldout_fraction: float = 0.05  # the first this fraction of records is held out
    seed: int = 0
    hidden: int = 512
    num_layers: int = 2
    norm_groups: int = 2
    top_l: int | None = None  # positives per record: the first top_l stored ids; None = all
    # Start at the training clusters' base rates: zero output kernel, bias = logit(prior).
    prior_init: bool = True
    eval_ks: tuple[int, ...] = (4, 8, 16, 32)
    checkpoint_every: int = 200
    eval_every: int = 0  # 0: evaluate only before and after training
    max_eval_records: int | None = None  # cap on held-out records evaluated (a fixed prefix)

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"eval_ks": list(self.eval_ks)}

    def router_config(self, in_dim: int, num_clusters: int) -> RouterConfig:
        return RouterConfig(in_dim=in_dim, num_clusters=num_clusters, hidden=self.hidden,
                            num_layers=self.num_layers, norm_groups=self.norm_groups)


def make_optimizer(tc: RouterTrainConfig, total_steps: int) -> optax.GradientTransformation:
    """Clip the global norm, then AdamW with linear warmup and cosine decay."""
    warmup = max(1, int(round(tc.warmup_fraction * total_steps)))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, tc.lr, warmup, max(total_steps, warmup + 1), end_value=tc.lr * tc.final_lr_fraction)

    def decay_mask(params):
        # Kernels only: the [G, in_dim/G] norm scale is 2-D too but is not a matrix.
        return jax.tree_util.tree_map_with_path(
            lambda p, _: "kernel" in jax.tree_util.keystr(p), params)

    return optax.chain(optax.clip_by_global_norm(tc.grad_clip),
                       optax.adamw(schedule, weight_decay=tc.weight_decay, mask=decay_mask))


def router_loss(model: Router, x: Array, topl: Array, assign: Array,
                weight: Array) -> tuple[Array, Array]:
    """BCE summed over clusters, averaged over the weighted rows.

    Args:
      x: [B, in_dim]; topl: [B, L] positives; assign: [V] cluster of each token;
      weight: [B] 1 for real rows, 0 for padding.
    Returns:
      (mean loss, logits [B, M]).
    """
    logits = model(x)
    return _bce(logits, topl, assign, weight), logits


def _bce(logits: Array, topl: Array, assign: Array, weight: Array) -> Array:
    """The mean over weighted rows of the BCE summed over clusters ([B, M] logits)."""
    y = cluster_labels(topl, assign, logits.shape[-1])
    bce = jnp.sum(optax.sigmoid_binary_cross_entropy(logits, y), -1)  # [B]
    return jnp.sum(bce * weight) / jnp.maximum(jnp.sum(weight), 1.0)


def _eval_batch(logits: Array, topl: Array, step: Array, assign: Array, sizes: Array,
                weight: Array, ks: tuple[int, ...]) -> dict[str, Array]:
    """One batch's sums for :func:`evaluate`, the loss included."""
    loss = _bce(logits, topl, assign, weight)
    return _eval_sums(logits, topl, step, assign, sizes, weight, ks) | {
        "bce": loss * jnp.sum(weight), "rows": jnp.sum(weight)}


def _eval_sums(logits: Array, topl: Array, step: Array, assign: Array, sizes: Array,
               weight: Array, ks: tuple[int, ...]) -> dict[str, Array]:
    """Sums over rows of recall / shortlist statistics for each k (see :func:`evaluate`)."""
    m = logits.shape[-1]
    c = assign[topl]  # [B, L] cluster of each positive token
    bucket = jnp.clip(step, 0, STEP_BUCKETS - 1)
    n_tok = jnp.sum(weight) * topl.shape[1]
    out = {"tokens": n_tok,
           "step_tokens": jax.ops.segment_sum(weight * topl.shape[1], bucket, STEP_BUCKETS),
           "positives": jnp.sum(weight * jnp.sum(cluster_labels(topl, assign, m), -1))}
    order = jax.lax.top_k(logits, max(ks))[1]  # [B, kmax], best first
    for k in ks:
        chosen = jnp.zeros(logits.shape, bool).at[jnp.arange(len(c))[:, None],
                                                  order[:, :k]].set(True)
        hit = jnp.take_along_axis(chosen, c, axis=1).astype(jnp.float32)  # [B, L]
        per_row = jnp.sum(hit, -1) * weight
        out[f"recall@{k}"] = jnp.sum(per_row)
        out[f"top1_recall@{k}"] = jnp.sum(hit[:, 0] * weight)
        out[f"shortlist@{k}"] = jnp.sum(jnp.sum(sizes[order[:, :k]], -1) * weight)
        out[f"step_recall@{k}"] = jax.ops.segment_sum(per_row, bucket, STEP_BUCKETS)
    return out


@lru_cache(maxsize=8)
def compiled_steps(graphdef: nnx.GraphDef, tc: RouterTrainConfig, total_steps: int,
                   ks: tuple[int, ...]):
    """(optimizer, train_step, eval_step), memoised so a resume or a test reuses the compile."""
    tx = make_optimizer(tc, total_steps)

    def loss_fn(params, x, topl, assign, weight):
        return router_loss(nnx.merge(graphdef, params), x, topl, assign, weight)

    @jax.jit
    def train_step(params, opt_state, x, topl, assign):
        weight = jnp.ones((x.shape[0],), jnp.float32)
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, topl, assign,
                                                                     weight)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    @jax.jit
    def eval_step(params, x, topl, step, assign, sizes, weight):
        return _eval_batch(nnx.merge(graphdef, params)(x), topl, step, assign, sizes, weight,
                           ks)

    return tx, train_step, eval_step


@lru_cache(maxsize=8)
def saved_eval_step(ks: tuple[int, ...]):
    """:func:`evaluate`'s step for a saved router's :class:`RouterParams`."""
    return jax.jit(lambda params, x, topl, step, assign, sizes, weight: _eval_batch(
        router_logits(params, x), topl, step, assign, sizes, weight, ks))


def _finish_eval(tot: dict[str, np.ndarray], ks: tuple[int, ...], vocab_size: int) -> dict:
    rows, toks = max(float(tot["rows"]), 1.0), max(float(tot["tokens"]), 1.0)
    out: dict[str, Any] = {"bce": float(tot["bce"]) / rows, "rows": int(tot["rows"]),
                           "mean_positive_clusters": float(tot["positives"]) / rows}
    st = np.maximum(tot["step_tokens"], 1.0)
    for k in ks:
        out[f"recall@{k}"] = float(tot[f"recall@{k}"]) / toks
        out[f"top1_recall@{k}"] = float(tot[f"top1_recall@{k}"]) / rows
        out[f"shortlist@{k}"] = float(tot[f"shortlist@{k}"]) / rows
        out[f"shortlist_fraction@{k}"] = out[f"shortlist@{k}"] / vocab_size
    # Per draft step (the last bucket is t >= STEP_BUCKETS - 1); steps never seen are left out.
    out["by_step"] = {
        (str(t) if t < STEP_BUCKETS - 1 else f"{t}+"): {
            f"recall@{k}": float(tot[f"step_recall@{k}"][t] / st[t]) for k in ks}
        for t in range(STEP_BUCKETS) if tot["step_tokens"][t] > 0}
    return out


def evaluate(eval_step, params: Any, data: RouterData, clusters: Clusters, batch: int,
             ks: tuple[int, ...], top_l: int) -> dict:
    """Held-out metrics over every record of ``data``.

    * ``bce``: the training loss (summed over clusters, mean over records);
    * ``recall@k``: fraction of the top-L tokens inside the top-k clusters' union;
    * ``top1_recall@k``: the same for the drafter's most probable token only;
    * ``shortlist@k``: mean tokens in the chosen clusters (the head rows the
      drafter would multiply), and ``shortlist_fraction@k`` of the vocabulary;
    * ``by_step``: recall@k per draft position.
    """
    assign, sizes = jnp.asarray(clusters.assign), jnp.asarray(clusters.sizes, jnp.float32)
    tot: dict[str, np.ndarray] = {}
    for s in range(0, len(data), batch):
        n = min(batch, len(data) - s)
        pad = batch - n  # one static shape: pad the last batch with zero-weight rows
        x = np.pad(data.x[s:s + n], ((0, pad), (0, 0)))
        topl = np.pad(data.topl[s:s + n, :top_l], ((0, pad), (0, 0)))
        step = np.pad(data.step[s:s + n], (0, pad))
        weight = (np.arange(batch) < n).astype(np.float32)
        r = eval_step(params, jnp.asarray(x), jnp.asarray(topl), jnp.asarray(step), assign,
                      sizes, jnp.asarray(weight))
        for k, v in r.items():
            tot[k] = tot.get(k, 0) + np.asarray(v, np.float64)
    return _finish_eval(tot, ks, clusters.vocab_size)


def static_baseline(prior: np.ndarray, data: RouterData, clusters: Clusters,
                    ks: tuple[int, ...], top_l: int) -> dict:
    """Recall / shortlist of always choosing the k clusters most often positive in training."""
    order = np.argsort(-prior, kind="stable")
    c = clusters.assign[data.topl[:, :top_l]]
    out = {}
    for k in ks:
        chosen = np.zeros(clusters.num_clusters, bool)
        chosen[order[:k]] = True
        out[f"recall@{k}"] = float(chosen[c].mean()) if c.size else 0.0
        out[f"top1_recall@{k}"] = float(chosen[c[:, 0]].mean()) if c.size else 0.0
        out[f"shortlist@{k}"] = int(clusters.sizes[order[:k]].sum())
    return out


# --------------------------------------------------------------------------- training loop


def _state_tree(params: Any, opt_state: Any, step: int) -> dict:
    return {"params": params, "opt_state": opt_state,
            "progress": {"step": np.array(step, np.int64)}}


def check_router_data(meta: dict[str, Any], *, drafter_fingerprint: str,
                      target_fields: dict[str, Any], clusters: Clusters | None = None) -> None:
    """Refuse router data collected with another drafter, or for another target / clusters."""
    if meta["drafter_fingerprint"] != drafter_fingerprint:
        raise RouterMismatchError(
            f"the router data was collected with another drafter (drafter_fingerprint "
            f"{str(meta['drafter_fingerprint'])[:12]} vs {drafter_fingerprint[:12]}); pass the "
            "drafter it was collected with (--drafter) or collect the data again with this one")
    others = [("the target", target_fields.get("vocab_size"))]
    if clusters is not None:
        others.append(("the clusters", clusters.vocab_size))
    for name, theirs in others:
        if meta["vocab_size"] != theirs:
            raise RouterMismatchError(f"the router data has vocab_size {meta['vocab_size']} but "
                                      f"{name} {theirs}; use the target the data was collected "
                                      "for")
    d = target_fields.get("hidden_size")
    if d is not None and meta["in_dim"] != 2 * d:
        raise RouterMismatchError(f"the router data has in_dim {meta['in_dim']}, expected "
                                  f"2 * hidden_size = {2 * d} for this target")


def train_router(data_dir: Path, clusters: Clusters, cfg: RouterTrainConfig, out_dir: Path, *,
                 drafter_fingerprint: str, target_fields: dict[str, Any],
                 ckpt_dir: Path | None = None, resume: bool = False,
                 stop_after: int | None = None, overwrite: bool = False,
                 extra_meta: dict | None = None, compare_with: tuple[Path, ...] = (),
                 progress: bool = True) -> dict:
    """Train a router on a data directory and write it with :func:`save_router`.

    Args:
      data_dir: see :func:`read_router_data`; its drafter fingerprint, vocabulary
        and width must match ``drafter_fingerprint`` / ``clusters`` / ``target_fields``.
      clusters: the token clusters the router scores (the labels follow them).
      out_dir: the router folder; written only when training completes, with
        ``metrics.json`` and ``loss.png`` beside the manifest.
      ckpt_dir: orbax checkpoints (params, optimizer state, step) every
        ``cfg.checkpoint_every`` steps and at the end, plus the training log;
        default ``<out_dir>.checkpoints`` next to the output folder.
      resume: continue from the latest checkpoint in ``ckpt_dir``; without it an
        existing checkpoint is refused rather than silently overwritten.
      stop_after: stop (after checkpointing) at this step, as an interrupt would.
      compare_with: saved routers for the same drafter (and target) to evaluate on the same
        held-out records, each with its own clusters: a router trained on other data or
        settings, compared on one footing. Loaded first, so a mismatch costs no training.
    Returns:
      metrics: held-out ``initial`` (before training) and ``final`` evaluations,
      the ``static_baseline``, cluster sizes, steps and ``complete``; ``compared``: for
      each of ``compare_with``, its path and held-out evaluation.
    """
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    ckpt_dir = Path(ckpt_dir) if ckpt_dir is not None else Path(f"{out_dir}.checkpoints")
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists; choose another --out or pass "
                              "--overwrite")
    check_router_data(read_router_meta(data_dir), drafter_fingerprint=drafter_fingerprint,
                      target_fields=target_fields, clusters=clusters)  # before the slow read
    others = [(Path(p), load_router(Path(p), drafter_fingerprint=drafter_fingerprint,
                                    target_fields=target_fields)) for p in compare_with]
    data = read_router_data(data_dir)
    top_l = cfg.top_l or data.meta["top_l"]
    if not 1 <= top_l <= data.meta["top_l"]:
        raise ValueError(f"top_l {cfg.top_l} must be in [1, {data.meta['top_l']}] (the data "
                         "stores that many tokens per record)")
    m = clusters.num_clusters
    ks = tuple(k for k in cfg.eval_ks if k <= m) or (m,)

    # Held out: the first records. A collector writes conversation by conversation, so a
    # contiguous split keeps (all but one) conversations wholly on one side.
    n_held = math.ceil(cfg.heldout_fraction * len(data)) if cfg.heldout_fraction > 0 else 0
    heldout, train = data.rows(slice(0, n_held)), data.rows(slice(n_held, None))
    if cfg.max_eval_records is not None:
        heldout = heldout.rows(slice(0, cfg.max_eval_records))
    per_epoch = len(train) // cfg.batch
    if per_epoch == 0:
        raise ValueError(f"{len(train)} training records, fewer than one batch of {cfg.batch}; "
                         "lower --batch-size or collect more data")
    total = cfg.steps if cfg.steps is not None else max(1, math.ceil(cfg.epochs * per_epoch))

    mgr = ckpt_manager(ckpt_dir)
    latest = mgr.latest_step()
    if latest is not None and not resume:
        raise FileExistsError(f"{ckpt_dir} already holds checkpoints (step {latest}); pass "
                              "--resume to continue, or choose another checkpoint folder")
    rcfg = cfg.router_config(data.meta["in_dim"], m)
    model = Router(rcfg, rngs=nnx.Rngs(cfg.seed))
    prior = cluster_prior(train.topl[:, :top_l], clusters.assign, m)
    if cfg.prior_init:
        # Start from the per-cluster base rates: the untrained router is then the static
        # frequency ranking, and training only has to learn the context's effect.
        # Without it the M sigmoids start at 0.5 and the first steps go into pushing
        # the ~M - L negatives down.
        last = model.layers[-1]
        last.kernel[...] = jnp.zeros_like(last.kernel[...])
        p = np.clip(prior, PRIOR_CLIP, 1 - PRIOR_CLIP)
        last.bias[...] = jnp.asarray(np.log(p / (1 - p)), jnp.float32)
    graphdef, params = nnx.split(model, nnx.Param)
    tx, train_step, eval_step = compiled_steps(graphdef, cfg, total, ks)
    opt_state = tx.init(params)
    assign = jnp.asarray(clusters.assign)

    run = {"train_config": cfg.to_json(), "total_steps": total, "batches_per_epoch": per_epoch,
           "data": {k: data.meta[k] for k in ("in_dim", "top_l", "vocab_size",
                                              "drafter_fingerprint", "num_records")},
           "clusters": hash_arrays([("assign", clusters.assign)])}
    log: dict[str, Any] = run | {"train": [], "eval": [], "wall_s": 0.0}
    step = 0
    if latest is not None:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                _state_tree(params, opt_state, 0))
        restored = mgr.restore(latest, args=ocp.args.StandardRestore(abstract))
        params, opt_state = restored["params"], restored["opt_state"]
        step = int(restored["progress"]["step"])
        log_path = ckpt_dir / LOG_FILE
        if log_path.exists():
            old = json.loads(log_path.read_text())
            diff = [k for k in run if old.get(k) != json.loads(json.dumps(run[k]))]
            if diff:
                raise ValueError(f"{ckpt_dir} was written with other training settings, data "
                                 f"or clusters ({', '.join(diff)} differ); resume with the same "
                                 "ones or use another checkpoint folder")
            log = old
            log["train"] = [r for r in log["train"] if r["step"] <= step]
            log["eval"] = [r for r in log["eval"] if r["step"] <= step]
        log.setdefault("resumed_at", []).append(step)

    def run_eval(tag: str) -> None:
        if len(heldout) == 0:
            return
        t0 = time.time()
        r = evaluate(eval_step, params, heldout, clusters, cfg.batch, ks, top_l)
        r |= {"step": step, "tag": tag, "eval_s": round(time.time() - t0, 2)}
        log["eval"].append(r)
        if progress:
            k = ks[min(1, len(ks) - 1)]
            tqdm.write(f"[eval {tag} step {step}] bce {r['bce']:.4f} recall@{k} "
                       f"{r[f'recall@{k}']:.4f} shortlist@{k} {r[f'shortlist@{k}']:.0f} "
                       f"({r['rows']} records)")

    def save(step: int) -> None:
        mgr.save(step, args=ocp.args.StandardSave(_state_tree(params, opt_state, step)),
                 force=True)
        mgr.wait_until_finished()
        write_json_atomic(ckpt_dir / LOG_FILE, log)

    if step == 0 and not any(r["tag"] == "initial" for r in log["eval"]):
        run_eval("initial")

    end = total if stop_after is None else min(total, stop_after)
    bar = tqdm(total=total, initial=step, desc="train router", unit="step",
               disable=not progress, dynamic_ncols=True)
    t_run, wall0, ema = time.time(), log["wall_s"], None
    plan_epoch, perm = -1, np.zeros(0, np.int64)
    while step < end:
        # The order is reshuffled every epoch from (seed, epoch): a step number alone fixes
        # the data position, so a resumed run sees the same batches.
        epoch, b = divmod(step, per_epoch)
        if epoch != plan_epoch:
            perm, plan_epoch = np.random.default_rng([cfg.seed, epoch]).permutation(
                len(train)), epoch
        rows = np.sort(perm[b * cfg.batch:(b + 1) * cfg.batch])
        params, opt_state, loss, gnorm = train_step(
            params, opt_state, jnp.asarray(train.x[rows]),
            jnp.asarray(train.topl[rows, :top_l]), assign)
        step += 1
        rec = {"step": step, "loss": float(loss), "grad_norm": float(gnorm),
               "wall_s": round(wall0 + time.time() - t_run, 2)}
        log["train"].append(rec)
        ema = rec["loss"] if ema is None else 0.95 * ema + 0.05 * rec["loss"]
        bar.set_postfix(loss=f"{ema:.3f}")
        bar.update(1)
        log["wall_s"] = wall0 + time.time() - t_run
        if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
            run_eval("periodic")
        if step % cfg.checkpoint_every == 0 or step == end:
            save(step)
    bar.close()
    if step >= total and not any(r["tag"] == "final" for r in log["eval"]):
        run_eval("final")
        write_json_atomic(ckpt_dir / LOG_FILE, log)
    mgr.close()

    evals = {r["tag"]: r for r in log["eval"]}
    metrics = {"complete": step >= total, "steps": step, "total_steps": total,
               "train_wall_s": round(log["wall_s"], 1),
               "records": {"train": len(train), "heldout": len(heldout)}, "top_l": top_l,
               "initial": evals.get("initial"), "final": evals.get("final"),
               "static_baseline": static_baseline(prior, heldout, clusters, ks, top_l)
               if len(heldout) else None,
               "clusters": cluster_size_stats(clusters), "router": rcfg.to_json(),
               "train_config": cfg.to_json(), "out": None}
    if metrics["complete"] and len(heldout):
        metrics["compared"] = [
            {"router": str(path), "final": evaluate(saved_eval_step(ks), p, heldout, c,
                                                    cfg.batch, ks, top_l)}
            for path, (_, p, c, _) in others]
    if metrics["complete"]:
        final = nnx.merge(graphdef, params)
        meta = {k: v for k, v in metrics.items() if k != "out"} | (extra_meta or {})
        path = save_router(out_dir, final.params(), rcfg, clusters,
                           drafter_fingerprint=drafter_fingerprint, target_fields=target_fields,
                           extra=meta, overwrite=overwrite)
        metrics["out"] = str(path)
        # Written after the manifest: they document the run and are not needed to load it.
        write_json_atomic(path / METRICS_FILE, metrics | (extra_meta or {}))
        write_json_atomic(path / LOG_FILE, log)
        plot_log(log, path / PLOT_FILE, metrics["static_baseline"])
    return metrics


def plot_log(log: dict, out: Path, baseline: dict | None = None) -> Path:
    """Training / held-out BCE, and held-out recall@k against the static baseline, as a PNG."""
    from specjax.bench.common import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    steps = np.array([r["step"] for r in log["train"]])
    vals = np.array([r["loss"] for r in log["train"]])
    if len(vals):
        ax[0].plot(steps, vals, alpha=0.25, color="C0", label="train BCE (per step)")
        w = max(1, len(vals) // 30)
        ax[0].plot(steps[w - 1:], np.convolve(vals, np.ones(w) / w, mode="valid"), color="C0",
                   label=f"train BCE (mean of {w})")
    ev = log["eval"]
    if ev:
        ax[0].plot([r["step"] for r in ev], [r["bce"] for r in ev], "o-", color="C3",
                   label="held-out BCE")
        ks = [int(k.split("@")[1]) for k in ev[0] if k.startswith("recall@")]
        for i, k in enumerate(ks):
            ax[1].plot([r["step"] for r in ev], [r[f"recall@{k}"] for r in ev], "o-",
                       color=f"C{i}", label=f"router top-{k} "
                       f"(~{ev[-1][f'shortlist@{k}']:.0f} tokens)")
            if baseline:
                ax[1].axhline(baseline[f"recall@{k}"], color=f"C{i}", ls="--", alpha=0.6,
                              label=f"static top-{k} ({baseline[f'shortlist@{k}']} tokens)")
    ax[0].set_ylabel("BCE summed over clusters")
    ax[1].set_ylabel("held-out recall of the drafter's top-L tokens")
    for a in ax:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle("DynaSpec router")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
