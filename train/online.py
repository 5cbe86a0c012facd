"""EvoSpec's online alignment: LoRA on the drafter's W_q and W_v, distilled from verified text.

EvoSpec (section 3.3, eq. 4-5) keeps the drafter's base weights frozen and adapts LoRA
matrices of rank r (32) and scale alpha / r (alpha = 32) on the query and value
projections, from samples of the text the target verified:

* **Samples.** A sample is a draft anchor: the root row t of a step whose first draft was
  wrong although the target's token was in the active vocabulary (a token outside it is the
  vocabulary's job, not the weights'). As in the paper's algorithm 1, it keeps its whole
  context x_<t (the verified sequence before it, at its true positions), the ``horizon``
  (gamma) verified tokens from it, the target's features for the teacher-forced context,
  and the target's top-K logits at the gamma drafted positions. Anchors of one sequence
  share it (:class:`Samples`).
* **Loss (eq. 5).** The drafter drafts gamma steps from the anchor, each step reading its
  own previous feature (as at inference) and the verified token; step j's distribution on
  the target's top-K support is compared with the target's: ``T^2 KL(p_T || q_T)`` at
  distillation temperature T, weighted by ``w_j = exp(-beta * L_base * (j - 1))`` where
  ``L_base`` is the sample's step-1 KL (no gradient): an uncertain drafter trains on the
  next token only, an aligned one on longer horizons. ``support="vocab"`` (not the
  paper's) adds the drafter's mass outside the top-K support to each term.
* **Updates.** A replay buffer of B (32) samples; when it fills, one optax step on the
  batch, then it empties. ``replay`` > 0 is not the paper's: the last ``replay`` samples
  are kept, an update runs per B new samples, and each of its steps draws a fresh batch of
  B from that window (experience replay), so one request's correlated samples are mixed
  with earlier ones instead of being fitted alone.

Until the thirty-third session a sample kept only the last 64 (``context``) rows before
its root, at positions from 0, so that samples had one shape. That cut regime is not
inference's: on held-out code answers the stage-2 drafter's first draft agrees 0.402 of
the time with its whole context and 0.247 with the cut, and an adapter fitted on cut
samples raised the cut figure while it lowered the whole-context one (0.402 -> 0.329;
docs/benchmarks.md, thirty-second session). This module holds the pure pieces (LoRA, the
sample layout, the loss, the update); the session that collects samples between requests
is :mod:`specjax.train.online_session`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import Array

from specjax import pytree
from specjax.drafter import DrafterConfig, DrafterParams, drafter_hidden, init_drafter_cache
from specjax.loop import bucket
from specjax.model import unfuse_layer

SUPPORTS = ("topk", "vocab")
# Matrices LoRA can adapt: a drafter layer's projections ("wq" is the first layer's, "wq@1"
# the second's), and the input fusion fc.
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "fc")


def split_target(name: str) -> tuple[str, int]:
    """A LoRA target's matrix and drafter layer: "wv" -> ("wv", 0), "wv@1" -> ("wv", 1)."""
    matrix, _, layer = name.partition("@")
    ok = matrix in LORA_TARGETS and (not layer or (layer.isdigit() and matrix != "fc"))
    if not ok:
        raise ValueError(f"LoRA target {name!r}: expected one of {', '.join(LORA_TARGETS)}, "
                         "optionally with @<drafter layer> (e.g. wv@1; not fc)")
    return matrix, int(layer or 0)


@dataclasses.dataclass(frozen=True)
class OnlineConfig:
    """EvoSpec's alignment settings (paper defaults; ``lr`` is the paper's, see the docs)."""

    rank: int = 32
    alpha: float = 32.0
    buffer: int = 32  # B: samples per update
    horizon: int = 6  # gamma: draft steps scored per sample
    top_k: int = 32  # K_logit: target logits kept per position
    beta: float = 0.3
    kd_temperature: float = 1.0
    lr: float = 1e-5
    steps_per_update: int = 1
    replay: int = 0  # 0: the paper's buffer, emptied by each update; N: a window of N samples
    support: str = "topk"  # "topk": eq. 5's; "vocab": also the mass outside it (alignment_loss)
    # The paper's; any of LORA_TARGETS, "@i" for drafter layer i > 0 (not the paper's).
    targets: tuple[str, ...] = ("wq", "wv")
    # Not the paper's: a prequential guard. The adapter drafts the next request only when,
    # on the newest request's rows (text it was not fitted on), its first draft hit the
    # target's token more often than the frozen drafter's; otherwise the frozen drafter
    # drafts while the adapter goes on learning (OnlineSession).
    guard: bool = False

    def __post_init__(self) -> None:
        if self.support not in SUPPORTS:
            raise ValueError(f"support must be one of {', '.join(SUPPORTS)}, got "
                             f"{self.support!r}")
        where = [split_target(t) for t in self.targets]
        if not self.targets or len(set(where)) != len(where):
            raise ValueError(f"LoRA targets must be distinct names of {', '.join(LORA_TARGETS)}"
                             f" (@i for layer i), got {list(self.targets)}")


@pytree.dataclass
class Lora:
    """Low-rank deltas W + s * a[name] @ b[name], s = alpha / rank, on the matrices named
    by the keys (:data:`LORA_TARGETS`, "@i" for drafter layer i; the paper's are W_q and
    W_v of its one layer).

    a[name]: [in, r]; b[name]: [r, out], the named matrix's shape [in, out].
    """

    a: dict[str, Array]
    b: dict[str, Array]
    scale: float = pytree.static_field()


def _target_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, int]]:
    t = cfg.target
    d, f = t.hidden_size, t.intermediate_size
    q, kv = t.num_heads * t.head_dim, t.num_kv_heads * t.head_dim
    return {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d), "w_gate": (d, f),
            "w_up": (d, f), "w_down": (f, d), "fc": (2 * d, d)}


def init_lora(cfg: DrafterConfig, rank: int, alpha: float, key: Array,
              targets: Sequence[str] = OnlineConfig.targets) -> Lora:
    """LoRA's initialisation on ``targets``: a ~ N(0, 1/in), b = 0, so the merged drafter
    starts as the base."""
    shapes, shape = _target_shapes(cfg), {}
    for n in targets:
        matrix, layer = split_target(n)
        if layer >= cfg.num_layers:
            raise ValueError(f"LoRA target {n!r}: the drafter has {cfg.num_layers} layer(s), "
                             f"numbered 0..{cfg.num_layers - 1}")
        shape[n] = shapes[matrix]
    keys = jax.random.split(key, len(targets))
    a = {n: jax.random.normal(k, (shape[n][0], rank)) / np.sqrt(shape[n][0])
         for n, k in zip(targets, keys, strict=True)}
    return Lora(a=a, b={n: jnp.zeros((rank, shape[n][1])) for n in targets},
                scale=alpha / rank)


def merge(base: DrafterParams, lora: Lora) -> DrafterParams:
    """The drafter with the deltas folded in (what the decode loop runs).

    The paper's drafter has one layer; in a deeper drafter a plain name adapts the first
    layer (the one that reads the fused [embedding; feature] input), "name@i" layer i, and
    layers without a target stay as they are. ``fc`` is that fusion, [2d, d].
    """
    def plus(name: str, w: Array) -> Array:
        return w + lora.scale * (lora.a[name] @ lora.b[name]).astype(w.dtype)

    per_layer: dict[int, dict[str, str]] = {}
    for name in lora.a:
        if name != "fc":
            matrix, i = split_target(name)
            per_layer.setdefault(i, {})[matrix] = name
    layers = list(base.layers)
    for i, names in per_layer.items():
        layer = unfuse_layer(layers[i])
        layers[i] = dataclasses.replace(layer, **{m: plus(n, getattr(layer, m))
                                                  for m, n in names.items()})
    fc = plus("fc", base.fc) if "fc" in lora.a else base.fc
    return dataclasses.replace(base, fc=fc, layers=tuple(layers))


@pytree.dataclass
class Samples:
    """Draft anchors, each with its whole context (the paper's (x_<i, z_i)), grouped by the
    verified sequence they come from: N sequences of W rows, M anchors, G = horizon, K.

    tokens: [N, W] int32 the sequences, zero-padded (W >= length + G, so every anchor's G
      draft steps read a row inside the array).
    feats: [N, W, d] the feature row i reads: the target's final-norm state at i - 1 (the
      drafter's input; zeros at row 0 and in the padding).
    seq: [M] int32 the sequence of each anchor; anchors: [M] int32 its root row t (the
      first draft drafts tokens[seq, t + 1]).
    top_ids, top_logits: [M, G, K] the target's top-K at rows t .. t + G - 1.
    valid: [M, G] bool positions inside the sequence (the position's next token exists).
    """

    tokens: Array
    feats: Array
    seq: Array
    anchors: Array
    top_ids: Array
    top_logits: Array
    valid: Array


def draft_horizon(dp: DrafterParams, cfg: DrafterConfig, embed: Array, s: Samples,
                  horizon: int) -> Array:
    """The drafter's G unrolled steps from each anchor: hidden states [M, G, d].

    Every row of a sequence is drafted once, teacher-forced on the target's features, as
    the decode loop's drafter reads its whole context: step 1 of anchor t is row t. Each
    anchor then gets that KV (rows <= t; the later rows are overwritten or masked out by
    the cache length) and drafts steps 2..G, step j at position t + j - 1 reading step
    j - 1's own output and the verified token, as a chain draft does at inference.
    """
    n, w = s.tokens.shape
    cache = init_drafter_cache(cfg, n, w, s.feats.dtype)
    pos = jnp.broadcast_to(jnp.arange(w), (n, w))
    h, cache = drafter_hidden(dp, cfg, embed, s.tokens, s.feats, pos, cache)
    outs = [h[s.seq, s.anchors]]  # [M, d]
    cache = dataclasses.replace(cache, k=tuple(k[s.seq] for k in cache.k),
                                v=tuple(v[s.seq] for v in cache.v), lengths=s.anchors + 1)
    for j in range(1, horizon):
        p = (s.anchors + j)[:, None]  # [M, 1]
        h, cache = drafter_hidden(dp, cfg, embed, s.tokens[s.seq[:, None], p],
                                  outs[-1][:, None], p, cache)
        cache = dataclasses.replace(cache, lengths=cache.lengths + 1)
        outs.append(h[:, 0])
    return jnp.stack(outs, axis=1)


def num_anchors(s: Samples) -> int:
    """M, the samples of ``s`` (its sequences are shared and not counted)."""
    return int(s.anchors.shape[0])


def gather_anchors(parts: Sequence[Samples], picks: Sequence[tuple[int, int]],
                   n: int = 0, w: int = 0) -> Samples:
    """One batch (numpy) of the anchors ``picks``, (part, anchor) pairs, from ``parts``
    (each one sequence, as :func:`specjax.train.online_session.collect_samples` gives).

    The batch holds the picked anchors' sequences, padded to the longest one's W (at least
    ``w``) and their count to a power of two (at least ``n``) with empty sequences, which
    no anchor reads, so updates on batches of B anchors compile for a few (N, W) only.
    """
    used = sorted({p for p, _ in picks})
    row = {p: i for i, p in enumerate(used)}
    w = max(w, *(parts[p].tokens.shape[1] for p in used))
    n = max(n, bucket(len(used), 1))
    first = parts[used[0]]
    tokens = np.zeros((n, w), np.int32)
    feats = np.zeros((n, w, first.feats.shape[-1]), first.feats.dtype)
    for p in used:
        t = parts[p].tokens.shape[1]
        tokens[row[p], :t] = parts[p].tokens[0]
        feats[row[p], :t] = parts[p].feats[0]
    pa = np.asarray(picks).reshape(-1, 2)

    def per_anchor(name: str) -> np.ndarray:
        return np.stack([getattr(parts[p], name)[a] for p, a in pa])

    return Samples(tokens=tokens, feats=feats,
                   seq=np.asarray([row[p] for p, _ in pa], np.int32),
                   anchors=per_anchor("anchors"), top_ids=per_anchor("top_ids"),
                   top_logits=per_anchor("top_logits"), valid=per_anchor("valid"))


def topk_kl(h: Array, head: Array, top_ids: Array, top_logits: Array,
            t: float = 1.0) -> tuple[Array, Array]:
    """KL(p_T || q_T) on the target's top-K support, eq. 5's per-step term (without T^2).

    h: [..., d] drafter hidden states; head: [V, d]; top_ids, top_logits: [..., K] the
    target's. Returns (kl [...], the drafter's logits on the support [..., K]).
    """
    rows = jnp.take(head, top_ids, axis=0)  # [..., K, d]
    q_logits = jnp.einsum("...d,...kd->...k", h, rows, preferred_element_type=jnp.float32)
    p = jax.nn.softmax(top_logits / t, axis=-1)
    kl = jnp.sum(p * (jnp.log(p + 1e-30) - jax.nn.log_softmax(q_logits / t, axis=-1)), -1)
    return kl, q_logits


def alignment_loss(lora: Lora, base: DrafterParams, cfg: DrafterConfig, embed: Array,
                   head: Array, s: Samples, oc: OnlineConfig) -> tuple[Array, dict]:
    """Eq. 5 averaged over samples: sum_j w_j T^2 KL(p_T^(j) || q_T^(j)) on the top-K support.

    With ``oc.support == "vocab"`` (not the paper's) each step's term also adds
    ``-log q_T(K)``, where q_T(K) is the mass the drafter's softmax over every head row
    puts on the support (the term is 0 when all of it is there): eq. 5 alone is unchanged
    when all K logits fall together, which lets tokens outside the support overtake the
    target's. The weights w_j use eq. 5's KL either way.

    Returns (loss, {"kl": [G] mean eq. 5 KL per step, "l_base": mean step-1 KL,
    "outside": [G] mean -log q_T(K) per step}).
    """
    h = draft_horizon(merge(base, lora), cfg, embed, s, oc.horizon)  # [N, G, d]
    t = oc.kd_temperature
    kl, q_logits = topk_kl(h, head, s.top_ids, s.top_logits, t)
    kl = jnp.where(s.valid, kl, 0.0)  # [N, G]
    term = kl
    if oc.support == "vocab":
        every = jnp.einsum("ngd,vd->ngv", h, head, preferred_element_type=jnp.float32) / t
        outside = jax.nn.logsumexp(every, -1) - jax.nn.logsumexp(q_logits / t, -1)
        outside = jnp.where(s.valid, outside, 0.0)  # [N, G], >= 0
        term = kl + outside
    else:
        outside = jnp.zeros_like(kl)
    l_base = jax.lax.stop_gradient(kl[:, 0])
    w = jnp.exp(-oc.beta * l_base[:, None] * jnp.arange(oc.horizon)[None, :])
    loss = jnp.sum(w * t * t * term) / kl.shape[0]
    denom = jnp.maximum(jnp.sum(s.valid, axis=0), 1)
    return loss, {"kl": jnp.sum(kl, axis=0) / denom, "l_base": jnp.mean(l_base),
                  "outside": jnp.sum(outside, axis=0) / denom}


def make_optimizer(oc: OnlineConfig) -> optax.GradientTransformation:
    """The online LoRA's optimiser: Adam at ``oc.lr`` after clipping the global norm to 1."""
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(oc.lr))


def update(lora: Lora, opt_state: Any, base: DrafterParams, cfg: DrafterConfig, embed: Array,
           head: Array, s: Samples, oc: OnlineConfig) -> tuple[Lora, Any, dict]:
    """``oc.steps_per_update`` optax steps on one full buffer. Jit with static cfg / oc."""
    batches = jax.tree.map(lambda a: jnp.broadcast_to(a, (oc.steps_per_update, *a.shape)), s)
    return update_on_batches(lora, opt_state, base, cfg, embed, head, batches, oc)


def update_on_batches(lora: Lora, opt_state: Any, base: DrafterParams, cfg: DrafterConfig,
                      embed: Array, head: Array, batches: Samples, oc: OnlineConfig
                      ) -> tuple[Lora, Any, dict]:
    """One optax step per batch of ``batches`` (each field with a leading [S] axis: S
    batches of B samples, the replay window's draws). Jit with static cfg / oc.

    Returns (lora, opt_state, stats): the first step's loss, the last's, and the last
    step's per-step KL and L_base.
    """
    tx = make_optimizer(oc)

    def one(carry, s):
        lora, opt_state = carry
        (loss, stats), grads = jax.value_and_grad(alignment_loss, has_aux=True)(
            lora, base, cfg, embed, head, s, oc)
        upd, opt_state = tx.update(grads, opt_state, lora)
        return (optax.apply_updates(lora, upd), opt_state), (loss, stats)

    (lora, opt_state), (losses, stats) = jax.lax.scan(one, (lora, opt_state), batches)
    return lora, opt_state, {"loss": losses[0], "loss_after": losses[-1], **jax.tree.map(
        lambda a: a[-1], stats)}


update_jit = jax.jit(update, static_argnames=("cfg", "oc"))
update_on_batches_jit = jax.jit(update_on_batches, static_argnames=("cfg", "oc"))


def memory_bytes(lora: Lora, base: DrafterParams, opt: optax.GradientTransformation) -> dict:
    """Trainable and optimiser-state bytes of LoRA against full-parameter updates (OSD)."""
    def nbytes(tree):
        return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree)))

    full = jax.tree.map(lambda x: x.astype(jnp.float32), base)
    return {"lora_trainable": nbytes(lora), "lora_optimizer": nbytes(opt.init(lora)),
            "full_trainable": nbytes(full), "full_optimizer": nbytes(opt.init(full))}
