"""Gemma 3: the sliding window in every attention path, tree verification at the window's
edge, and the refusals. Logit and greedy parity with transformers per feature is in
``test_parity.py`` (the ``gemma3-*`` features; its greedy test runs the KV-cache decode path
40 tokens past the window)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import specjax
from specjax.config import ModelConfig, UnsupportedModelError
from specjax.kernels.tree_attention import tree_attention, window_visible
from specjax.model import forward_hidden, init_cache, lm_head
from tests.tiny import FAMILIES, GEMMA3, make_hf_checkpoint, make_hf_model

WINDOW = GEMMA3["sliding_window"]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gemma3")
    src = make_hf_checkpoint(tmp / "hf", "gemma3")
    return specjax.load(specjax.convert(src, tmp / "sj", progress=False))


def test_window_boundary_is_transformers():
    """Key at distance window - 1 is visible, at distance window is not (kv > q - window)."""
    lengths = jnp.array([10])
    positions = jnp.array([[10, 11]])  # two new tokens written at rows 10, 11
    vis = np.asarray(window_visible(lengths, positions, 16, 4))[0]
    assert vis[0].tolist() == [False] * 7 + [True] * 9  # 10 - 7 = 3 < 4, 10 - 6 = 4
    assert vis[1, 7] is np.False_ and vis[1, 8] and vis[1, 11]


def test_the_window_changes_the_logits():
    """Without a visible effect of the window, the parity tests would not test it."""
    toks = torch.tensor(np.random.RandomState(0).randint(3, 256, (1, 24)))
    with torch.no_grad():
        short = make_hf_model("gemma3")(toks).logits.numpy()[0]
        full = make_hf_model("gemma3", sliding_window=4096)(toks).logits.numpy()[0]
    assert np.abs(short[:WINDOW] - full[:WINDOW]).max() < 1e-5
    assert np.abs(short[WINDOW:] - full[WINDOW:]).max() > 1e-3


def _tree():
    """A 7-node tree over rows 0..6: root 0; children 1, 2; 3 under 1; 4, 5 under 3; 6
    under 2. Returns (parent, depth, ancestor-or-self mask [T, T])."""
    parent = [-1, 0, 0, 1, 3, 3, 2]
    depth = [0, 1, 1, 2, 3, 3, 2]
    anc = np.zeros((7, 7), bool)
    for i in range(7):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parent[j]
    return parent, np.array(depth), anc


_fwd = jax.jit(forward_hidden, static_argnames=("cfg", "attention_impl"))


def _logits(target, seqs: list[np.ndarray]) -> np.ndarray:
    """[N, V] each sequence's last logits from one plain (causal) forward, right-padded."""
    n = max(map(len, seqs))
    toks = np.stack([np.pad(s, (0, n - len(s))) for s in seqs])
    pos = jnp.broadcast_to(jnp.arange(n), toks.shape)
    h, _, _ = _fwd(target.params, target.cfg, jnp.asarray(toks), pos,
                   init_cache(target.cfg, len(seqs), n))
    logits = np.asarray(lm_head(target.params, h))
    return logits[np.arange(len(seqs)), [len(s) - 1 for s in seqs]]


@pytest.mark.parametrize("impl", ["dense", "xla"])
def test_tree_nodes_see_what_the_sequence_sees(gemma, impl):
    """Every tree node's logits equal a plain forward over prefix + its root path, with the
    prefix (11 tokens) longer than the window (8) and the tree reaching past it: the model's
    dense mask and the tree-attention XLA path (the reference shares its mask code)."""
    cfg, params = gemma.cfg, gemma.params
    rs = np.random.RandomState(1)
    prefix = rs.randint(3, 256, 11)
    tokens = rs.randint(3, 256, 7)
    _, depth, anc = _tree()
    n = len(prefix)
    _, cache, _ = _fwd(params, cfg, jnp.asarray(prefix[None]), jnp.arange(n)[None],
                       init_cache(cfg, 1, 32))
    cache = dataclasses.replace(cache, lengths=jnp.array([n]))
    hidden, _, _ = _fwd(params, cfg, jnp.asarray(tokens[None]), jnp.asarray(n + depth[None]),
                        cache, block_mask=jnp.asarray(anc[None]), attention_impl=impl)
    got = np.asarray(lm_head(params, hidden))[0]
    # Node i's sequence: the prefix, then its ancestors and itself (parents come first).
    want = _logits(gemma, [np.concatenate([prefix, tokens[anc[i]]]) for i in range(7)])
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_pallas_refuses_the_window():
    q = jnp.zeros((1, 2, 2, 16))
    kv = jnp.zeros((1, 8, 1, 16))
    with pytest.raises(ValueError, match="does not implement sliding-window"):
        tree_attention(q, kv, kv, jnp.array([3]), jnp.ones((1, 2, 2), bool), impl="pallas",
                       window=4, positions=jnp.array([[3, 4]]))
    with pytest.raises(ValueError, match="needs the queries' positions"):
        tree_attention(q, kv, kv, jnp.array([3]), jnp.ones((1, 2, 2), bool), impl="xla",
                       window=4)


def test_drafter_rows_are_refused_with_a_window(gemma):
    cfg = gemma.cfg
    with pytest.raises(ValueError, match="sliding-window layers"):
        forward_hidden(gemma.params, cfg, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2)),
                       init_cache(cfg, 1, 8), write_rows=jnp.array([[0, 1]]))


def _hf_config(**changes) -> dict:
    d = FAMILIES["gemma3"][0](**{**GEMMA3, "vocab_size": 256, "hidden_size": 64,
                                 "intermediate_size": 96, "num_attention_heads": 4,
                                 "num_key_value_heads": 2}).to_dict()
    return {**d, **changes}


def test_config_reads_both_forms():
    cfg = ModelConfig.from_hf(_hf_config())
    assert cfg.layer_types == tuple(GEMMA3["layer_types"]) and cfg.sliding_window == WINDOW
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert cfg.attn_scale == 24 ** -0.5 and cfg.norm_plus_one and cfg.tie_word_embeddings
    # transformers v4's config.json: rope_theta / rope_local_base_freq / sliding_window_pattern.
    old = _hf_config(rope_parameters=None, layer_types=None, rope_theta=5e5,
                     rope_local_base_freq=2e4, sliding_window_pattern=2, num_hidden_layers=4,
                     rope_scaling={"rope_type": "linear", "factor": 8.0})
    cfg = ModelConfig.from_hf(old)
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_linear_factor) == (5e5, 2e4, 8.0)
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    hash(cfg)


@pytest.mark.parametrize("changes, match", [
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0 is not supported"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0 is not supported"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(hidden_activation="gelu"), "hidden_activation 'gelu'"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(layer_types=["chunked_attention", "full_attention", "sliding_attention"]),
     r"layer_types \['chunked_attention'\]"),
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0},
                           "sliding_attention": {"rope_type": "default"}}),
     "rope_type 'yarn' on full_attention"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default"},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     "rope_type 'linear' on sliding_attention"),
    (dict(model_type="gemma3", text_config={}), "multimodal"),
])
def test_refusals_name_the_feature(changes, match):
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_hf(_hf_config(**changes))
