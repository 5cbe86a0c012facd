"""EAGLE drafter training with optax over cached target hidden states.

The NNX :class:`~specjax.drafter.EagleDrafter` is split into ``(graphdef, params)``
at the jit boundary: the jitted step takes and returns plain pytrees (params,
optax state), which is also exactly what the orbax checkpoints hold.

Loss (EAGLE-1), over the rows selected by the loss mask::

    smooth_l1(ĥ_t, f_t)  +  0.1 * CE(softmax(lm_head(f_t)) -> log_softmax(lm_head(ĥ_t)))

where drafter row t reads x_t and f_{t-1} (f_{-1} = 0) and ĥ_t is its output.
The target's embedding and LM head are frozen inputs of the step, never trained.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from functools import lru_cache, partial
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
from specjax.config import ModelConfig
from specjax.drafter import (
    DrafterConfig,
    DrafterParams,
    EagleDrafter,
    identity_layer,
    read_drafter,
    save_drafter,
)
from specjax.model import Params, unfuse_layer
from specjax.train.data import (
    HiddenSplit,
    atomic_savez,
    gather_rows,
    plan_batches,
    row_loss_mask,
    rows_for,
)

LOG_FILE = "training_log.json"
BEST_FILE = "best_params.npz"  # keep_best's params, beside the checkpoints
PLOT_FILE = "loss.png"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters; frozen so it can be stored and compared on resume."""

    steps: int | None = None  # total optimizer steps; None -> epochs * batches per epoch
    epochs: float = 1.0
    token_budget: int = 2048  # padded tokens per step (rows = budget // bucket length)
    lr: float = 5e-4
    warmup_fraction: float = 0.05
    final_lr_fraction: float = 0.1  # cosine decays to lr * this
    weight_decay: float = 0.01  # on matrices only, not on norms or biases
    b1: float = 0.9
    b2: float = 0.95  # EAGLE's AdamW betas
    grad_clip: float = 0.5  # EAGLE clips the global norm at 0.5
    ce_weight: float = 0.1
    # Weight of a total-variation term, 1 - sum_x min(p, q) over the scored head: the
    # rejection probability of a draft sampled from q at temperature 1 (DistillSpec's TVD).
    # The CE term is forward KL, which bounds it but does not target it.
    tv_weight: float = 0.0
    # The head the CE term scores during training: None for the whole vocabulary, or a
    # shortlist spec such as "fr:16384" (the rows ``--vocab fr:16384`` drafts from). The
    # teacher is renormalised over the same rows. Held-out evaluation always uses the
    # whole vocabulary, so top-1 agreement stays comparable between runs.
    train_vocab: str | None = None
    # Training-time test: draft steps unrolled on the drafter's own features (1 = EAGLE-1)
    # and the weight decay of each deeper step's loss.
    ttt_steps: int = 1
    ttt_decay: float = 1.0
    noise: float = 0.2  # width of the uniform feature noise U(-noise/2, noise/2); 0 = off
    # "last-layer": the target's last layer with its residual outputs (wo, w_down) zeroed;
    # "last-layer-raw": an unmodified copy; "random": normal(0.02) like EAGLE.
    init: str = "last-layer"
    # "lstsq": the fc starts as the ridge least-squares map [e(x_t); f_{t-1}; 1] -> f_t over
    # the training rows (closed form, seconds); "normal": normal(0.02) like EAGLE.
    fc_init: str = "lstsq"
    # A drafter folder whose weights start the run (fine-tuning, e.g. on self-distilled
    # data); overrides init and fc_init.
    init_from: str | None = None
    # Decoder layers of the drafter (EAGLE: 1). With init_from a shallower drafter, its
    # layers are loaded and the new ones start as the identity (its predictions unchanged).
    drafter_layers: int = 1
    # Target layers whose outputs the drafter's feature adds (DrafterConfig.taps); the
    # hidden-state cache must hold them. () = EAGLE-1.
    drafter_taps: tuple[int, ...] = ()
    # The tap weights' learning rate as a multiple of ``lr``: they start at zero under a
    # trained drafter, and at the fine-tuning rate they barely leave it (measured: Frobenius
    # norm ~1 after 882 steps at 1e-4, against ~100 for the fc).
    tap_lr_scale: float = 1.0
    # The dtype of the training step's drafter products: "bfloat16" is mixed precision (the
    # weights, Adam's moments and the losses stay float32; the drafter's matmuls, its inputs
    # and the student's logits run in bf16, accumulated in float32, as EAGLE trains on
    # GPUs). Held-out evaluation always runs in float32, as inference does here.
    compute_dtype: str = "float32"
    seed: int = 0
    checkpoint_every: int = 50
    eval_every: int = 0  # 0: evaluate only before and after training
    max_eval_tokens: int | None = None  # cap the held-out tokens evaluated (None: all)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        # Absent at their defaults, so checkpoints written before taps (or the TV term)
        # resume with the same settings.
        taps, scale, tv = d.pop("drafter_taps"), d.pop("tap_lr_scale"), d.pop("tv_weight")
        dtype = d.pop("compute_dtype")
        return d | ({"drafter_taps": list(taps)} if taps else {}) | (
            {"tap_lr_scale": scale} if scale != 1.0 else {}) | ({"tv_weight": tv} if tv else {}) | (
            {"compute_dtype": dtype} if dtype != "float32" else {})


# --------------------------------------------------------------------------- model and loss


INIT_MODES = ("last-layer", "last-layer-raw", "random")
COMPUTE_DTYPES = ("float32", "bfloat16")


def init_drafter(target_cfg: ModelConfig, target_params: Params,
                 tc: TrainConfig) -> EagleDrafter:
    """EAGLE-1 drafter (no input norm, fc bias) for this target.

    ``tc.init`` chooses the decoder layer's start:

    * ``"last-layer"`` (default): a copy of the target's last layer with the
      output projections of its two residual branches (``wo``, ``w_down``)
      zeroed, so the untrained layer is the identity. An unmodified copy
      (``"last-layer-raw"``) is a poor start: that layer was trained on the
      pre-norm residual stream, and on the drafter's small fc output its MLP
      writes values ~20x larger than the final-norm features it must match
      (smooth-L1 ~22 and CE ~300 nats on SmolLM2, against ~1 and ~16 for a
      random layer). Zeroing the branch outputs keeps the pretrained q/k/v and
      gate/up projections while starting from a sane output. A layer with sandwich
      norms (Gemma 3) normalises each branch's output after its projection, and an
      RMS norm of a zero vector has a gradient of 1/sqrt(eps): the first update of
      ``wo`` would jump the branch from 0 to full scale (measured on Gemma 3 270M:
      the training loss went from 2 to over 100 in a few steps at lr 1e-4). There
      the post-norm scales are zeroed instead, which starts from the same identity
      with a smooth gradient (the scale's is the normalised branch output).
    * ``"random"``: normal(0.02), EAGLE's own from-scratch layer.

    The EAGLE-1 layer has no input norm, so the target's is dropped. The fc over
    [embedding; feature] starts random (normal 0.02), as in :class:`EagleDrafter`.
    """
    if tc.init not in INIT_MODES:
        raise ValueError(f"init must be one of {INIT_MODES}, not {tc.init!r}")
    if tc.compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, not "
                         f"{tc.compute_dtype!r}")
    cfg = DrafterConfig(target=target_cfg, input_norm=False, fc_bias=True,
                        num_layers=tc.drafter_layers, taps=tuple(tc.drafter_taps))
    init_layer = None
    if tc.init != "random":
        init_layer = unfuse_layer(target_params.layers[-1])  # [in, out], whatever the load
        if tc.init == "last-layer":
            init_layer = identity_layer(init_layer)
    return EagleDrafter(cfg, rngs=nnx.Rngs(tc.seed), init_layer=init_layer)


def lstsq_fc(train: HiddenSplit, embed: Array, ridge: float = 1e-3,
             chunk_rows: int = 16384) -> tuple[np.ndarray, np.ndarray]:
    """Ridge least-squares fc: ([2d, d] weight, [d] bias) fitting f_t from [e(x_t); f_{t-1}].

    With the decoder layer's residual branches zeroed (``init="last-layer"``) the
    drafter's output at step 0 *is* the fc output, so this makes the untrained
    drafter the best linear predictor of the target's next feature over the
    scored rows. On a CPU budget of a few hundred steps this matters more than
    anything else: on SmolLM2 it starts at ~24% held-out top-1 agreement where a
    random fc starts at ~0% and reaches ~10% after 200 steps. The normal
    equations are accumulated in float64 over chunks (X^T X is only
    (2d+1)^2), then solved with a ridge of ``ridge * mean(diag(X^T X))``.
    """
    emb = np.asarray(embed, np.float32)
    d = emb.shape[1]
    xtx = np.zeros((2 * d + 1, 2 * d + 1))
    xty = np.zeros((2 * d + 1, d))
    # A run of sequences adjacent in the flat arrays is one read: the features come about
    # ``chunk_rows`` at a time, also from accelerator memory (``--states-on-device``), where a
    # slice per sequence would be a transfer each. Every read is one ``window`` of rows (the
    # last one shifted back to fit), since JAX compiles a slice for each size it sees.
    order = np.argsort(train.offsets, kind="stable")
    ends = train.offsets + train.lengths
    total = int(ends.max(initial=0))
    window = min(total, max(chunk_rows, int(train.lengths.max(initial=0))))
    first = 0
    while first < len(order):
        last = first + 1
        while last < len(order) and ends[order[last]] - train.offsets[order[first]] <= chunk_rows:
            last += 1
        s0 = min(int(train.offsets[order[first]]), total - window)
        block = np.asarray(train.hidden[s0:s0 + window], np.float32)
        xs, ys = [], []
        for i in order[first:last]:
            s, n = int(train.offsets[i]), int(train.lengths[i])
            f = block[s - s0:s - s0 + n]
            m = row_loss_mask(train.assistant[s:s + n], n)
            prev = np.concatenate([np.zeros((1, d), np.float32), f[:-1]])
            xs.append(np.concatenate([emb[train.tokens[s:s + n]], prev,
                                      np.ones((n, 1), np.float32)], 1)[m])
            ys.append(f[m])
        x, y = np.concatenate(xs), np.concatenate(ys)
        xtx += x.T @ x
        xty += x.T @ y
        first = last
    lam = ridge * np.trace(xtx) / len(xtx)
    w = np.linalg.solve(xtx + lam * np.eye(len(xtx)), xty).astype(np.float32)
    return w[:2 * d], w[2 * d]


def _smooth_l1(x: Array) -> Array:
    """Huber with beta = 1 (torch's SmoothL1Loss, EAGLE's regression loss)."""
    ax = jnp.abs(x)
    return jnp.where(ax < 1.0, 0.5 * x * x, ax - 0.5)


def scored_rows(x: Array, mask: Array, cap: int) -> tuple[Array, Array]:
    """The rows of ``x`` [B, T, d] where ``mask`` [B, T] holds, packed into [cap, d].

    Returns (rows [cap, d], valid [cap]); rows past the mask's count repeat row 0 and
    are invalid. The caller picks ``cap`` >= the count (see :func:`score_cap`), so no
    scored row is dropped; the point is that the V-wide head runs on ``cap`` rows,
    not on every prompt and padding row of the batch.
    """
    idx, valid = scored_index(mask, cap)
    return x.reshape(-1, x.shape[-1])[idx], valid


def scored_index(mask: Array, cap: int) -> tuple[Array, Array]:
    """(flat row indices [cap], valid [cap]) of ``mask`` [B, T]'s true rows, as packed by
    :func:`scored_rows`; computed once per step and reused for every tensor packed."""
    flat = mask.reshape(-1)
    idx = jnp.nonzero(flat, size=cap, fill_value=0)[0]
    return idx, jnp.arange(cap) < jnp.sum(flat.astype(jnp.int32))


def score_cap(n_scored: int, n_rows: int, steps: int = 8) -> int:
    """A static row count >= ``n_scored`` from ``steps`` fractions of ``n_rows`` (few shapes)."""
    return max(1, math.ceil(max(n_scored, 1) * steps / n_rows) * n_rows // steps)


def ttt_mask(t: int, step: int) -> Array:
    """[t, step * t] keys visible to the queries of unrolled draft step ``step`` (1-based).

    Keys are the drafter rows of steps 1..step, each ``t`` long. A step-k query at
    position p plays the k-th token of a draft chain whose first token sits at
    p - k + 1: at inference it sees the context rows (step 1, positions <= p - k + 1,
    computed from the target's features) and the chain's own rows, the step-m row at
    position p - k + m for m = 2..k (computed from the drafter's predicted features).
    Step 1 is plain causal attention.
    """
    i = jnp.arange(t)[:, None]
    j = jnp.arange(step * t)[None, :]
    m, pos = j // t + 1, j % t
    return ((m == 1) & (pos <= i - step + 1)) | ((m >= 2) & (pos == i - step + m))


def unrolled_features(model: EagleDrafter, embed: Array, tokens: Array, feats: Array,
                      steps: int) -> list[Array]:
    """Training-time test (EAGLE-3, HASS): the drafter's predictions for ``steps`` draft steps.

    Step 1 is teacher-forced (row t reads the target's f_{t-1}); step k >= 2 reads the
    drafter's own step k-1 prediction at t-1 and attends as a depth-k chain node would
    (:func:`ttt_mask`), so the deeper drafts are trained on the inputs they get at
    inference. Tokens stay teacher-forced: step k row t is scored on f_t, the state
    after x_t, like step 1.

    Args:
      tokens: [B, T]; feats: [B, T, d] step 1's input features (f_{t-1}, noised).
    Returns:
      ``steps`` predicted features, each [B, T, d].
    """
    from specjax.drafter import drafter_hidden, init_drafter_cache

    b, t = tokens.shape
    dp = model.params()
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    # One cache holds every step's rows: step k writes rows (k-1)T .. kT-1. Lengths stay 0,
    # so the block mask alone decides what each query sees.
    cache = init_drafter_cache(model.cfg, b, steps * t, feats.dtype)
    preds = []
    for k in range(1, steps + 1):
        if k > 1:
            feats = jnp.pad(preds[-1][:, :-1], ((0, 0), (1, 0), (0, 0)))
        block = jnp.broadcast_to(ttt_mask(t, k), (b, t, k * t))
        big = jnp.pad(block, ((0, 0), (0, 0), (0, (steps - k) * t)))  # later steps: unseen
        rows = jnp.broadcast_to((k - 1) * t + jnp.arange(t), (b, t))
        pred, cache = drafter_hidden(dp, model.cfg, embed, tokens, feats, positions, cache,
                                     block_mask=big, write_rows=rows)
        preds.append(pred)
    return preds


def eagle_loss(model: EagleDrafter, embed: Array, head: Array, tokens: Array, hidden: Array,
               loss_mask: Array, noise_key: Array | None, noise: float,
               ce_weight: float, cap: int | None = None, ttt_steps: int = 1,
               ttt_decay: float = 1.0, taps: Array | None = None, tv_weight: float = 0.0,
               compute_dtype: str = "float32") -> tuple[Array, dict[str, Array]]:
    """EAGLE-1 loss over masked rows (optionally unrolled), plus agreement statistics.

    Args:
      embed: [V, d] the target's frozen embedding.
      head: [N, d] rows of its frozen LM head that the CE term scores: all V rows, or
        a training shortlist (then teacher and student are both softmaxed over it).
      tokens: [B, T] x_t; hidden: [B, T, d] the target's f_t; loss_mask: [B, T].
      noise_key: PRNG key for the uniform feature noise (None: no noise, eval).
      cap: static number of rows the head scores (>= the mask's count); None scores
        all B*T rows.
      ttt_steps: draft steps unrolled (:func:`unrolled_features`); 1 is EAGLE-1.
      ttt_decay: step k's loss is weighted ``ttt_decay ** (k - 1)``.
      taps: [B, T, k, d] the outputs of the drafter's tapped target layers (None for a
        drafter without taps); they enter the input feature, never the regression target.
      tv_weight: weight of the total-variation term ``1 - accept`` (see ``accept``).
      compute_dtype: the drafter's inputs (embedding, features, taps) and the student's
        head in this dtype, to match a ``model`` whose weights were cast to it; the
        regression target, the teacher and every loss stay float32.
    Returns:
      (loss, stats) with stats sums over masked rows: reg, ce, top1 (argmax
      of drafter logits == argmax of teacher logits over ``head``), accept
      (``sum_x min(p, q)`` over ``head``, teacher and drafter softmaxed at temperature 1:
      the probability that a draft sampled from q is accepted) and n (rows), for step 1;
      top1_k for the unrolled steps k >= 2.
    """
    cd = jnp.dtype(compute_dtype)
    embed, feats = embed.astype(cd), hidden.astype(cd)
    if model.cfg.taps:
        taps = taps.astype(cd)
        feats = model.cfg.target_features(model.params(), feats,
                                          tuple(taps[:, :, i] for i in range(taps.shape[2])))
    feats = jnp.pad(feats[:, :-1], ((0, 0), (1, 0), (0, 0)))  # f_{t-1}, zeros at t = 0
    if noise_key is not None and noise > 0:
        # EAGLE perturbs the input features so the drafter tolerates its own
        # imperfect predictions at deeper draft steps.
        feats = feats + jax.random.uniform(noise_key, feats.shape, feats.dtype,
                                           -noise / 2, noise / 2)
    if ttt_steps == 1:
        preds = [model(embed, tokens, feats)]  # ĥ_t [B, T, d]
    else:
        preds = unrolled_features(model, embed, tokens, feats, ttt_steps)
    m = loss_mask.astype(jnp.float32)
    n = jnp.sum(m)
    if cap is None:
        h_rows, m_rows = hidden, m
    else:
        idx, valid = scored_index(loss_mask, cap)
        h_rows, m_rows = hidden.reshape(-1, hidden.shape[-1])[idx], valid.astype(jnp.float32)
    teacher = jnp.einsum("...d,vd->...v", h_rows, head, preferred_element_type=jnp.float32)
    p = jax.lax.stop_gradient(jax.nn.softmax(teacher, axis=-1))
    target = jnp.argmax(teacher, -1)
    total, stats = 0.0, {"n": n}
    for k, pred in enumerate(preds, start=1):
        reg = jnp.mean(_smooth_l1(pred.astype(jnp.float32) - hidden), axis=-1)  # [B, T]
        p_rows = pred if cap is None else pred.reshape(-1, pred.shape[-1])[idx]
        logits = jnp.einsum("...d,vd->...v", p_rows, head.astype(cd),
                            preferred_element_type=jnp.float32)
        logq = jax.nn.log_softmax(logits, axis=-1)
        ce = -jnp.sum(p * logq, axis=-1)  # [B, T] or [cap]
        accept = jnp.sum(jnp.minimum(p, jnp.exp(logq)), axis=-1)
        top1 = jnp.sum((jnp.argmax(logits, -1) == target).astype(jnp.float32) * m_rows)
        total = total + ttt_decay ** (k - 1) * (
            jnp.sum(reg * m) + ce_weight * jnp.sum(ce * m_rows)
            + tv_weight * jnp.sum((1.0 - accept) * m_rows))
        if k == 1:
            stats |= {"reg": jnp.sum(reg * m), "ce": jnp.sum(ce * m_rows), "top1": top1,
                      "accept": jnp.sum(accept * m_rows)}
        else:
            stats[f"top1_{k}"] = top1
    return total / jnp.maximum(n, 1.0), stats


def make_optimizer(tc: TrainConfig, total_steps: int) -> optax.GradientTransformation:
    """Clip the global norm, then AdamW with linear warmup and cosine decay."""
    warmup = max(1, int(round(tc.warmup_fraction * total_steps)))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, tc.lr, warmup, max(total_steps, warmup + 1), end_value=tc.lr * tc.final_lr_fraction)
    decay_mask = partial(jax.tree.map, lambda a: a.ndim >= 2)
    steps = [optax.clip_by_global_norm(tc.grad_clip),
             optax.adamw(schedule, b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay,
                         mask=decay_mask)]
    if tc.tap_lr_scale != 1.0:
        steps.append(optax.masked(optax.scale(tc.tap_lr_scale), _tap_weights))
    return optax.chain(*steps)


def _tap_weights(params: Any) -> Any:
    """A tree of bools over ``params``: True at the tap weights (``tap_fc``)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: any(getattr(k, "key", getattr(k, "name", None)) == "tap_fc"
                            for k in path), params)


@lru_cache(maxsize=8)
def compiled_steps(graphdef: nnx.GraphDef, tc: TrainConfig, total_steps: int):
    """(optimizer, train_step, eval_step), memoised so repeated runs (a resume, tests)
    with the same model and settings reuse the compiled code."""
    tx = make_optimizer(tc, total_steps)
    return (tx, *make_steps(graphdef, tx, tc))


def make_steps(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, tc: TrainConfig):
    """Jitted (train_step, eval_step) over pure pytrees; one compile per bucket shape."""

    def loss_fn(params, embed, head, tokens, hidden, mask, key, cap=None, taps=None,
                compute_dtype="float32"):
        # The float32 weights cast inside the step: their gradients come back in float32.
        params = jax.tree.map(lambda a: a.astype(compute_dtype), params)
        return eagle_loss(nnx.merge(graphdef, params), embed, head, tokens, hidden, mask, key,
                          tc.noise, tc.ce_weight, cap, tc.ttt_steps, tc.ttt_decay, taps,
                          tc.tv_weight, compute_dtype)

    @partial(jax.jit, donate_argnums=(0, 1), static_argnames=("cap",))
    def train_step(params, opt_state, embed, head, tokens, hidden, mask, key, cap=None,
                   taps=None):
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, embed, head, tokens, hidden, mask, key, cap, taps, tc.compute_dtype)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss, stats | {"grad_norm": optax.tree.norm(grads)}

    @jax.jit
    def eval_step(params, embed, head, tokens, hidden, mask, taps=None):
        return loss_fn(params, embed, head, tokens, hidden, mask, None, taps=taps)[1]

    return train_step, eval_step


def evaluate(eval_step: Callable, params: Any, embed: Array, head: Array, split: HiddenSplit,
             token_budget: int, ce_weight: float, max_tokens: int | None = None,
             bucket_width: int = 128) -> dict:
    """Held-out loss, top-1 agreement and ``accept`` (the expected acceptance of a draft
    sampled at temperature 1, :func:`eagle_loss`), averaged over every masked row of
    ``split``. The reported loss is the smooth-L1 + CE objective (no TV term), so runs with
    and without ``--tv-weight`` stay comparable.

    With training-time test the result also has ``top1_k``: step k's agreement when the
    k-1 earlier drafts were right (their tokens are teacher-forced).
    """
    lengths = split.lengths
    if max_tokens is not None:  # a fixed prefix of the split, so every evaluation sees the same
        keep = int(np.searchsorted(np.cumsum(lengths), max_tokens, side="right"))
        lengths = lengths[: max(keep, 1)]
    buckets = training_buckets(split.lengths, bucket_width)
    tot: dict[str, float] = {}
    for t, rows in plan_batches(lengths, buckets, token_budget):
        b = split.batch(t, rows, rows_for(t, token_budget))
        s = eval_step(params, embed, head, jnp.asarray(b["tokens"]), jnp.asarray(b["hidden"]),
                      jnp.asarray(b["loss_mask"]),
                      taps=jnp.asarray(b["taps"]) if "taps" in b else None)
        for k, v in s.items():
            tot[k] = tot.get(k, 0.0) + float(v)
    n = max(tot.get("n", 0.0), 1.0)
    deeper = {k: v / n for k, v in tot.items() if k.startswith("top1_")}
    return {"loss": (tot.get("reg", 0.0) + ce_weight * tot.get("ce", 0.0)) / n,
            "reg": tot.get("reg", 0.0) / n, "ce": tot.get("ce", 0.0) / n,
            "top1": tot.get("top1", 0.0) / n, "accept": tot.get("accept", 0.0) / n,
            "rows": int(tot.get("n", 0.0)), **deeper}


def training_buckets(lengths: np.ndarray, width: int = 128) -> tuple[int, ...]:
    """Padded lengths for sequences of ``lengths`` [n]: four up to 512 tokens (as every
    cache so far), then one per ``width`` tokens, so that short conversations mixed with
    long ones (1,200-token contexts) are not padded to a quarter of the longest."""
    from specjax.train.data import length_buckets

    longest = int(lengths.max()) if len(lengths) else 16
    return length_buckets(longest, n=max(4, math.ceil(longest / width)))


# --------------------------------------------------------------------------- checkpoints


def ckpt_manager(ckpt_dir: Path, keep: int = 2) -> ocp.CheckpointManager:
    """Synchronous orbax manager keeping the last ``keep`` training checkpoints."""
    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                        enable_async_checkpointing=False)
    return ocp.CheckpointManager(Path(ckpt_dir).absolute(), options=opts)


def _state_tree(params: Any, opt_state: Any, step: int, epoch: int, batch: int,
                tokens_seen: int) -> dict:
    progress = {"step": step, "epoch": epoch, "batch": batch, "tokens_seen": tokens_seen}
    return {"params": params, "opt_state": opt_state,
            "progress": {k: np.array(v, np.int64) for k, v in progress.items()}}


# --------------------------------------------------------------------------- training loop


@dataclasses.dataclass
class TrainResult:
    params: DrafterParams
    cfg: DrafterConfig
    log: dict
    meta: dict


def load_weights_into(model: EagleDrafter, path: Path, target_cfg: ModelConfig) -> None:
    """Overwrite ``model``'s weights with those of the drafter folder ``path``.

    A folder with fewer layers than ``model`` fills its first layers; the rest keep their
    start (the identity under the default init), so the grown drafter predicts as the
    folder's does at step 0.
    """
    cfg, dp, _ = read_drafter(path, target_cfg)
    if (cfg.input_norm, cfg.fc_bias) != (model.cfg.input_norm, model.cfg.fc_bias):
        raise ValueError(f"{path} is not an EAGLE-1 drafter without input norm and with an fc "
                         f"bias (input_norm={cfg.input_norm}, fc_bias={cfg.fc_bias}); it cannot "
                         "start this run")
    if cfg.num_layers > model.cfg.num_layers:
        raise ValueError(f"{path} has {cfg.num_layers} decoder layers and this run trains "
                         f"{model.cfg.num_layers}; pass --drafter-layers {cfg.num_layers} or "
                         "more to start from it")
    if cfg.taps and cfg.taps != model.cfg.taps:
        raise ValueError(f"{path} reads target layers {list(cfg.taps)} and this run's drafter "
                         f"{list(model.cfg.taps)}; pass --drafter-taps "
                         f"{','.join(map(str, cfg.taps))} to start from it")
    model.fc[...] = jnp.asarray(dp.fc, jnp.float32)
    if model.fc_bias is not None:
        model.fc_bias[...] = jnp.asarray(dp.fc_bias, jnp.float32)
    if dp.tap_fc is not None:  # else a tapped run from an untapped drafter: tap_fc stays 0
        model.tap_fc[...] = jnp.asarray(dp.tap_fc, jnp.float32)
    # The folder's layers, in order; the model may have more.
    for layer, loaded in zip(model.layers[:cfg.num_layers], dp.layers, strict=True):
        for name in layer:
            layer[name][...] = jnp.asarray(getattr(loaded, name), jnp.float32)


def _prior_tokens(path: Path) -> int:
    """Tokens the drafter at ``path`` was trained on, its own starting point's included."""
    from specjax.checkpoint import read_manifest
    from specjax.drafter import FORMAT

    meta = read_manifest(Path(path), FORMAT)["meta"]  # the manifest alone: no tensors read
    return int(meta.get("tokens_seen_total", meta.get("tokens_seen", 0)))


def train_drafter(target_cfg: ModelConfig, target_params: Params, train: HiddenSplit,
                  heldout: HiddenSplit | None, tc: TrainConfig, ckpt_dir: Path, *,
                  train_ids: np.ndarray | None = None, resume: bool = False,
                  stop_after: int | None = None, time_limit: float | None = None,
                  progress: bool = True, log_every: int = 1, on_device: bool = False,
                  bucket_width: int = 128, keep_best: bool = False) -> TrainResult:
    """Train an EAGLE drafter on cached hidden states, checkpointing as it goes.

    Args:
      train, heldout: splits from :func:`specjax.train.data.load_split`.
      ckpt_dir: orbax checkpoints (params, optimizer state, step, data
        position) every ``tc.checkpoint_every`` steps and at the end, plus the
        training log so far.
      train_ids: [N] the shortlist ``tc.train_vocab`` names (required with it): the
        LM-head rows the CE term scores during training.
      resume: continue from the latest checkpoint in ``ckpt_dir``; without it
        an existing checkpoint is refused rather than silently overwritten.
      stop_after: stop (after checkpointing) once this step is reached, as an
        interrupt would; the run can then be resumed.
      time_limit: seconds of training (this run's, compiles included) after which the step
        under way is the last, checkpointed as ``stop_after`` would: a machine lent for
        minutes still gets its drafter back (``meta["complete"]`` is then False).
      log_every: read the step's loss back (a device sync) every this many steps.
      on_device: keep the training split's states in accelerator memory and gather each
        batch there (:func:`~specjax.train.data.gather_rows`), and score every row rather
        than pack the scored ones (one compiled step per bucket instead of one per bucket
        and packed size). For a GPU, where the host's batch copies would be the
        bottleneck; the losses are the same up to summation order.
      bucket_width: padded lengths past 512 come every this many tokens
        (:func:`training_buckets`); wider means fewer compiled shapes, more padding.
      keep_best: return the params of the evaluation (initial, periodic or at the end)
        with the highest held-out top-1, not the last step's: a run over few new tokens
        may peak and then overfit. The best params so far are kept beside the
        checkpoints (``best_params.npz``), so a resumed run still knows them; the
        checkpoints themselves stay the last step's, which resuming needs. A run stopped
        by ``time_limit`` or ``stop_after`` is evaluated where it stopped.
    Returns:
      final params and config, the log, and the metadata for ``save_drafter``
      (``meta["kept"]``: the step and top-1 of the params returned, with ``keep_best``).
    """
    from tqdm.auto import tqdm

    ckpt_dir = Path(ckpt_dir)
    buckets = training_buckets(train.lengths, bucket_width)
    # The batch plan of one epoch; the order is reshuffled every epoch from (seed, epoch), so
    # a step number alone fixes the data position and a resumed run sees the same batches.
    per_epoch = len(plan_batches(train.lengths, buckets, tc.token_budget))
    total = tc.steps if tc.steps is not None else max(1, math.ceil(tc.epochs * per_epoch))

    if tc.ttt_steps < 1 or not 0 < tc.ttt_decay <= 1:
        raise ValueError(f"ttt_steps must be >= 1 and ttt_decay in (0, 1], not "
                         f"{tc.ttt_steps} and {tc.ttt_decay}")
    if tc.fc_init not in ("lstsq", "normal"):
        raise ValueError(f"fc_init must be lstsq or normal, not {tc.fc_init!r}")
    mgr = ckpt_manager(ckpt_dir)
    latest = mgr.latest_step()
    if latest is not None and not resume:
        raise FileExistsError(f"{ckpt_dir} already holds checkpoints (step {latest}); pass "
                              "--resume to continue, or choose another checkpoint folder")
    # An untapped drafter ignores any taps the cache holds; a tapped one reads them all, in order.
    if tc.drafter_taps and tuple(tc.drafter_taps) != tuple(train.tap_layers):
        raise ValueError(f"the drafter reads target layers {list(tc.drafter_taps)} but the "
                         f"hidden-state cache stores {list(train.tap_layers)}; cache the data "
                         "again with the same --drafter-taps (another --cache-dir)")
    model = init_drafter(target_cfg, target_params, tc)
    if tc.init_from is not None and latest is None:
        load_weights_into(model, Path(tc.init_from), target_cfg)
    elif tc.fc_init == "lstsq" and latest is None:  # a resumed run restores the params
        t0 = time.time()
        w, b = lstsq_fc(train, target_params.embed)
        model.fc[...] = jnp.asarray(w)
        if model.fc_bias is not None:
            model.fc_bias[...] = jnp.asarray(b)
        if progress:
            tqdm.write(f"least-squares fc init [{time.time() - t0:.0f}s]")
    graphdef, params = nnx.split(model, nnx.Param)
    # Copy: the layer may alias the target's own weight buffers, and the train step donates
    # its params (donating an alias would delete the target's weights).
    params = jax.tree.map(lambda a: jnp.array(a, copy=True), params)
    tx, train_step, eval_step = compiled_steps(graphdef, tc, total)
    opt_state = tx.init(params)
    embed, head = target_params.embed, target_params.head
    if (tc.train_vocab is None) != (train_ids is None):
        raise ValueError("train_vocab and train_ids go together: pass the shortlist's ids")
    # Pre-gathered once: the training step streams N contiguous rows, not a V-wide head.
    train_head = head if train_ids is None else jnp.take(head, jnp.asarray(train_ids), axis=0)
    # On device: the flat fp16 states once (~1.1 KB per token and tap at d=576).
    flat = None if not on_device else {
        "hidden": jnp.asarray(train.hidden),
        **({"taps": jnp.asarray(train.taps)} if tc.drafter_taps else {})}

    log: dict[str, Any] = {"train_config": tc.to_json(), "total_steps": total,
                           "batches_per_epoch": per_epoch, "train": [], "eval": [],
                           "wall_s": 0.0}
    step, tokens_seen = 0, 0
    if latest is not None:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                _state_tree(params, opt_state, 0, 0, 0, 0))
        restored = mgr.restore(latest, args=ocp.args.StandardRestore(abstract))
        params, opt_state = restored["params"], restored["opt_state"]
        step = int(restored["progress"]["step"])
        tokens_seen = int(restored["progress"]["tokens_seen"])
        log_path = ckpt_dir / LOG_FILE
        if log_path.exists():
            old = json.loads(log_path.read_text())
            if old.get("train_config") != tc.to_json():
                raise ValueError(f"{ckpt_dir} was written with other training settings; "
                                 "resume with the same ones or use another checkpoint folder")
            log = old
            log["train"] = [r for r in log["train"] if r["step"] <= step]
            log["eval"] = [r for r in log["eval"] if r["step"] <= step]
        log.setdefault("resumed_at", []).append(step)

    best_path = ckpt_dir / BEST_FILE
    best = None  # (its evaluation, host params): the best so far, with keep_best
    if keep_best and latest is not None and log.get("best") and best_path.exists():
        with np.load(best_path) as z:
            leaves = [z[f"a{i}"] for i in range(len(z.files))]
        best = (log["best"], jax.tree.unflatten(jax.tree.structure(params), leaves))

    def run_eval(tag: str) -> None:
        nonlocal best
        if heldout is None or len(heldout) == 0:
            return
        t0 = time.time()
        r = evaluate(eval_step, params, embed, head, heldout, tc.token_budget, tc.ce_weight,
                     tc.max_eval_tokens, bucket_width)
        r |= {"step": step, "tag": tag, "tokens_seen": tokens_seen,
              "eval_s": round(time.time() - t0, 1)}
        log["eval"].append(r)
        if keep_best and (best is None or r["top1"] > best[0]["top1"]):
            # A host copy: the train step donates (and so deletes) the device params.
            best = (r, jax.device_get(params))
            atomic_savez(best_path, **{f"a{i}": np.asarray(a)
                                       for i, a in enumerate(jax.tree.leaves(best[1]))})
            log["best"] = r
        if progress:
            deeper = "".join(f" {k} {v:.4f}" for k, v in r.items() if k.startswith("top1_"))
            tqdm.write(f"[eval {tag} step {step}] loss {r['loss']:.4f} top1 {r['top1']:.4f}"
                       f" accept {r['accept']:.4f}{deeper} ({r['rows']} rows)")

    def save(step: int) -> None:
        epoch, batch = divmod(step, per_epoch)
        mgr.save(step, args=ocp.args.StandardSave(
            _state_tree(params, opt_state, step, epoch, batch, tokens_seen)), force=True)
        mgr.wait_until_finished()
        write_json_atomic(ckpt_dir / LOG_FILE, log)

    if step == 0 and not any(r["tag"] == "initial" for r in log["eval"]):
        run_eval("initial")  # the untrained drafter: the baseline for top-1 agreement

    end = total if stop_after is None else min(total, stop_after)
    bar = tqdm(total=total, initial=step, desc="train drafter", unit="step",
               disable=not progress, dynamic_ncols=True)
    base_key = jax.random.PRNGKey(tc.seed)
    plan_epoch, plan = -1, []
    t_run = time.time()
    wall0 = log["wall_s"]
    ema = None
    while step < end:
        epoch, b = divmod(step, per_epoch)
        if epoch != plan_epoch:
            rng = np.random.default_rng([tc.seed, epoch])
            plan, plan_epoch = plan_batches(train.lengths, buckets, tc.token_budget, rng), epoch
        t, rows = plan[b]
        batch = train.batch(t, rows, rows_for(t, tc.token_budget), features=flat is None)
        key = jax.random.fold_in(base_key, step)
        if flat is None:
            cap = score_cap(int(batch["loss_mask"].sum()), batch["loss_mask"].size)
            hidden = jnp.asarray(batch["hidden"])
            taps = jnp.asarray(batch["taps"]) if tc.drafter_taps else None
        else:
            cap, index, valid = None, jnp.asarray(batch["index"]), jnp.asarray(batch["valid"])
            hidden = gather_rows(flat["hidden"], index, valid)
            taps = gather_rows(flat["taps"], index, valid) if tc.drafter_taps else None
        params, opt_state, loss, stats = train_step(
            params, opt_state, embed, train_head, jnp.asarray(batch["tokens"]), hidden,
            jnp.asarray(batch["loss_mask"]), key, cap=cap, taps=taps)
        step += 1
        tokens_seen += int(train.lengths[rows].sum())
        if step % log_every == 0 or step == end:
            n = max(float(stats["n"]), 1.0)
            rec = {"step": step, "loss": float(loss), "reg": float(stats["reg"]) / n,
                   "ce": float(stats["ce"]) / n, "top1": float(stats["top1"]) / n,
                   "accept": float(stats["accept"]) / n,
                   "grad_norm": float(stats["grad_norm"]), "tokens_seen": tokens_seen,
                   **{k: float(v) / n for k, v in stats.items() if k.startswith("top1_")},
                   "wall_s": round(wall0 + time.time() - t_run, 2)}
            log["train"].append(rec)
            ema = rec["loss"] if ema is None else 0.95 * ema + 0.05 * rec["loss"]
            bar.set_postfix(loss=f"{ema:.3f}", top1=f"{rec['top1']:.3f}")
        bar.update(1)
        log["wall_s"] = wall0 + time.time() - t_run
        if tc.eval_every and step % tc.eval_every == 0 and step < total:
            run_eval("periodic")
        if time_limit is not None and time.time() - t_run >= time_limit and step < end:
            end = step  # out of time: checkpoint this step and stop
            tqdm.write(f"time limit {time_limit:g} s reached at step {step}")
        if step % tc.checkpoint_every == 0 or step == end:
            save(step)
    bar.close()
    log["wall_s"] = wall0 + time.time() - t_run
    if step >= total and not any(r["tag"] == "final" for r in log["eval"]):
        run_eval("final")
        write_json_atomic(ckpt_dir / LOG_FILE, log)  # the state at this step is saved already
    elif keep_best and not any(r["step"] == step for r in log["eval"]):
        run_eval("stopped")  # keep_best compares the last step too
        write_json_atomic(ckpt_dir / LOG_FILE, log)
    mgr.close()

    evals = {r["tag"]: r for r in log["eval"]}
    returned = evals.get("final")  # the evaluation of the params returned
    if best is not None:
        last = [r for r in log["eval"] if r["step"] == step][-1]
        if best[0]["step"] != step:
            params = jax.tree.map(jnp.asarray, best[1])
        returned = best[0] | {"last_step": step, "last_top1": last["top1"]}
    final = nnx.merge(graphdef, params)
    prior = _prior_tokens(Path(tc.init_from)) if tc.init_from else 0
    seen = tokens_seen if best is None else best[0]["tokens_seen"]  # the returned params'
    meta = {"tokens_seen": seen, "prior_tokens_seen": prior,
            "tokens_seen_total": prior + seen, "steps": step, "total_steps": total,
            "complete": step >= total, "train_wall_s": round(log["wall_s"], 1),
            "heldout_top1": (returned or {}).get("top1"),
            "kept": None if best is None else {k: returned[k] for k in
                                               ("step", "tag", "top1", "last_step", "last_top1")},
            "heldout_loss": (returned or {}).get("loss"),
            "initial_heldout_top1": evals.get("initial", {}).get("top1"),
            "initial_heldout_loss": evals.get("initial", {}).get("loss"),
            "init": {"last-layer": "layer: target's last layer, wo and w_down zeroed, input "
                                   "norm dropped",
                     "last-layer-raw": "layer: target's last layer, input norm dropped",
                     "random": "layer: normal(0.02)"}[tc.init]
            + ("; fc: ridge least squares" if tc.fc_init == "lstsq" else "; fc: normal(0.02)"),
            "train_config": tc.to_json()}
    return TrainResult(params=final.params(), cfg=final.cfg, log=log, meta=meta)


def plot_log(log: dict, out: Path) -> Path:
    """Loss curve (training loss, smoothed, and held-out points) as a PNG."""
    from specjax.bench.common import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(1, 3, figsize=(16, 4))
    steps = np.array([r["step"] for r in log["train"]])
    for i, key in enumerate(("loss", "top1")):
        vals = np.array([r[key] for r in log["train"]])
        if len(vals):
            ax[i].plot(steps, vals, alpha=0.25, color="C0", label=f"train {key} (per step)")
            w = max(1, len(vals) // 30)
            smooth = np.convolve(vals, np.ones(w) / w, mode="valid")
            ax[i].plot(steps[w - 1:], smooth, color="C0", label=f"train {key} (mean of {w})")
        ev = [r for r in log["eval"]]
        if ev:
            ax[i].plot([r["step"] for r in ev], [r[key] for r in ev], "o-", color="C3",
                       label=f"held-out {key}")
        ax[i].set_xlabel("step")
        ax[i].set_ylabel(key if key == "loss" else "top-1 agreement with target")
        ax[i].grid(alpha=0.3)
        ax[i].legend()
    # The learning curve: held-out agreement against every token the drafter has seen,
    # the runs it was fine-tuned from included (log scale: data is what a drafter lacks).
    prior = log.get("meta", {}).get("prior_tokens_seen", 0)
    ev = [r for r in log["eval"] if "tokens_seen" in r]
    keys = ["top1"] + sorted({k for r in ev for k in r if k.startswith("top1_")})
    for key in keys:
        pts = [(prior + r["tokens_seen"], r[key]) for r in ev if key in r]
        if pts:
            label = "draft step 1" if key == "top1" else f"draft step {key[5:]} (unrolled)"
            ax[2].plot(*zip(*pts, strict=True), "o-", label=label)
    ax[2].set_xscale("symlog", linthresh=max(prior, 1e4))
    ax[2].set_xlabel("tokens seen (earlier runs included)")
    ax[2].set_ylabel("held-out top-1 agreement")
    ax[2].grid(alpha=0.3)
    if ev:
        ax[2].legend()
    ce_weight = log.get("train_config", {}).get("ce_weight", 0.1)
    fig.suptitle(f"EAGLE drafter: smooth-L1 + {ce_weight:g} CE")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_drafter(out: Path, result: TrainResult, extra_meta: dict | None = None,
                  overwrite: bool = False) -> Path:
    """save_drafter plus the training log JSON and the loss-curve PNG in the same folder."""
    meta = result.meta | (extra_meta or {})
    path = save_drafter(Path(out), result.cfg, result.params, meta=meta, overwrite=overwrite)
    # Written after the manifest: they document the run and are not needed to load it.
    write_json_atomic(path / LOG_FILE, result.log | {"meta": meta})
    plot_log(result.log | {"meta": meta}, path / PLOT_FILE)
    return path
