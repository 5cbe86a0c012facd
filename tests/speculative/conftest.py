"""A tiny target and a drafter fitted to it, so speculative steps accept real paths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from specjax.drafter import DrafterConfig, EagleDrafter
from specjax.loaded import Drafter
from specjax.model import forward_hidden, init_cache, lm_head

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [40, 41, 42, 43, 44]]


def fit_drafter(target, seqs: list[list[int]], steps: int = 300) -> Drafter:
    """Train an EAGLE drafter on the target's own features over ``seqs`` (teacher-forced)."""
    t = target
    n = max(map(len, seqs))
    tokens = np.zeros((len(seqs), n), np.int32)
    mask = np.zeros((len(seqs), n), bool)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)], mask[i, : len(s)] = s, True
    tokens = jnp.asarray(tokens)
    pos = jnp.broadcast_to(jnp.arange(n), tokens.shape)
    feats, _, _ = forward_hidden(t.params, t.cfg, tokens, pos, init_cache(t.cfg, len(seqs), n))
    inputs = jnp.concatenate([jnp.zeros_like(feats[:, :1]), feats[:, :-1]], axis=1)
    teacher = jax.nn.softmax(lm_head(t.params, feats), -1)
    mask = jnp.asarray(mask)

    model = EagleDrafter(DrafterConfig(t.cfg), rngs=nnx.Rngs(0), init_layer=t.params.layers[-1])
    opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
        def loss_fn(m):
            h = m(t.params.embed, tokens, inputs)
            logp = jax.nn.log_softmax(lm_head(t.params, h), -1)
            ce = -jnp.sum(teacher * logp, -1)
            reg = jnp.mean(jnp.abs(h - feats), -1)
            return jnp.sum((ce + reg) * mask) / mask.sum()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    for _ in range(steps):
        step(model, opt)
    return Drafter(cfg=model.cfg, params=model.params())
