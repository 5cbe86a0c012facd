"""Logit and greedy parity against transformers' PyTorch models, one test per feature."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import specjax
from specjax.model import forward, init_cache
from tests.tiny import FAMILIES, make_hf_checkpoint

LLAMA3_ROPE = dict(
    rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
)

FEATURES = {
    "llama": ("llama", {}),
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    "llama-gqa-4to1": ("llama", dict(num_key_value_heads=1)),
    "llama3-rope-scaling": ("llama", LLAMA3_ROPE),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "qwen2-bias": ("qwen2", {}),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3-qk-norm": ("qwen3", {}),
    "qwen3-qk-norm-head-dim": ("qwen3", dict(head_dim=32)),
    # tests.tiny.GEMMA3: local and global layers with a window of 8 (the 24-token prompt and
    # the 40-token greedy continuation run past it), q/k norms, sandwich norms, GeGLU,
    # sqrt(d) embeddings, query_pre_attn_scalar 24 != head_dim 16, untied head.
    "gemma3-sliding-window": ("gemma3", {}),
    "gemma3-tied-mqa-linear-rope": ("gemma3", dict(
        tie_word_embeddings=True, num_key_value_heads=1,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}

PROMPT_LEN = 24


@pytest.fixture(scope="module", params=list(FEATURES))
def pair(request, tmp_path_factory):
    """(transformers model, specjax Target) with the same random weights."""
    family, overrides = FEATURES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    src = make_hf_checkpoint(tmp / "hf", family, **overrides)
    target = specjax.load(specjax.convert(src, tmp / "sj", progress=False))
    hf = FAMILIES[family][1].from_pretrained(src, dtype=torch.float32).eval()
    return request.param, hf, target


def _prompt(batch: int = 2) -> np.ndarray:
    return np.random.RandomState(0).randint(3, 256, (batch, PROMPT_LEN))


def test_logits_match_transformers(pair):
    name, hf, target = pair
    toks = _prompt()
    with torch.no_grad():
        ref = hf(torch.tensor(toks)).logits.numpy()
    positions = jnp.broadcast_to(jnp.arange(PROMPT_LEN), toks.shape)
    logits, _ = forward(target.params, target.cfg, jnp.asarray(toks), positions,
                        init_cache(target.cfg, 2, 64))
    err = np.abs(np.asarray(logits) - ref).max()
    assert err <= 1e-4, f"{name}: max |logits - transformers| = {err}"


def test_greedy_continuation_matches_transformers(pair):
    name, hf, target = pair
    toks = _prompt(1)[0].tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([toks]), max_new_tokens=40, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(toks):].tolist()
    got = specjax.generate(target, [toks], max_new_tokens=40, stop_on_eos=False).tokens[0]
    assert got == ref, f"{name}: greedy continuation differs at {_first_diff(got, ref)}"


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def test_llama3_rope_scaling_is_applied(tmp_path):
    """The scaled and unscaled configs must give different logits, or the parity test is moot."""
    toks = _prompt(1)
    outs = []
    for kw in ({"rope_theta": 500000.0}, LLAMA3_ROPE):
        src = make_hf_checkpoint(tmp_path / f"hf{len(kw)}", "llama", **kw)
        t = specjax.load(specjax.convert(src, tmp_path / f"sj{len(kw)}", progress=False))
        assert (t.cfg.rope_scaling is not None) == ("rope_scaling" in kw)
        pos = jnp.broadcast_to(jnp.arange(PROMPT_LEN), toks.shape)
        outs.append(np.asarray(forward(t.params, t.cfg, jnp.asarray(toks), pos,
                                       init_cache(t.cfg, 1, 32))[0]))
    assert np.abs(outs[0] - outs[1]).max() > 1e-3
