"""EAGLE drafter import: tiny torch references -> HF folders -> specjax, numerics and refusals.

The torch modules below mirror SafeAILab/EAGLE's structure (cnets1.py for
EAGLE-1/2, cnets.py for EAGLE-3) with transformers' Llama/Qwen2 building
blocks, so the tensor names and the math are the ones real checkpoints use.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file
from torch import nn
from transformers.models.llama import modeling_llama as ml
from transformers.models.qwen2 import modeling_qwen2 as mq

from specjax.checkpoint import CheckpointError
from specjax.config import ModelConfig
from specjax.convert.eagle import (
    convert_eagle,
    convert_eagle3,
    convert_eagle_folder,
    eagle_kind,
    is_eagle3_folder,
    is_eagle_folder,
)
from specjax.drafter import DrafterMismatchError, drafter_hidden, init_drafter_cache, read_drafter
from specjax.eagle3 import (
    eagle3_candidates,
    eagle3_fuse,
    eagle3_hidden,
    eagle3_tap_layers,
    export_eagle3_state,
    init_eagle3_cache,
    read_eagle3,
)
from tests.tiny import BASE, edit_config, edit_tensors

B, T = 2, 7
# An EAGLE config.json as EAGLE ships them: a LlamaConfig-like dict with one layer.
EAGLE_BASE = {k: v for k, v in BASE.items() if k not in ("bos_token_id", "eos_token_id")}
EAGLE_BASE |= dict(num_hidden_layers=1, rope_theta=5000.0)


def target_cfg(family: str = "llama", **changes) -> ModelConfig:
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}[family]
    return ModelConfig.from_hf(dict(BASE, model_type=family, architectures=[arch], **changes))


def _perturb(module: nn.Module) -> None:
    """Random init leaves norms at 1 and biases at 0: move them so the test sees them."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))


def _causal(t: int) -> torch.Tensor:
    return torch.full((t, t), float("-inf")).triu(1)[None, None]


# --------------------------------------------------------------------------- EAGLE-1/2


class TorchEagle1(nn.Module):
    """cnets1.py's drafter: fc over cat(embedding, feature), one decoder layer whose
    input_layernorm EAGLE-1 drops (index 0)."""

    def __init__(self, hf: dict, family: str, fc_bias: bool, input_norm: bool):
        super().__init__()
        config_cls, layer_cls, rope_cls = {
            "llama": (transformers.LlamaConfig, ml.LlamaDecoderLayer, ml.LlamaRotaryEmbedding),
            "qwen2": (transformers.Qwen2Config, mq.Qwen2DecoderLayer, mq.Qwen2RotaryEmbedding),
        }[family]
        config = config_cls(**hf, attn_implementation="eager")
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.layers = nn.ModuleList([layer_cls(config, 0)])
        if not input_norm:
            self.layers[0].input_layernorm = nn.Identity()
        self.fc = nn.Linear(2 * d, d, bias=fc_bias)
        self.rotary = rope_cls(config)  # non-persistent buffers: not in the state dict

    def forward(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([self.embed_tokens(tokens), features], dim=-1))
        pos = torch.arange(tokens.shape[1])[None].expand(tokens.shape)
        return self.layers[0](x, attention_mask=_causal(tokens.shape[1]), position_ids=pos,
                              position_embeddings=self.rotary(x, pos))


def make_eagle1(path, family="llama", fc_bias=True, input_norm=False, fmt="safetensors",
                seed=0):
    """Write an HF-form EAGLE-1 folder; returns (path, torch module)."""
    torch.manual_seed(seed)
    hf = dict(EAGLE_BASE, model_type=family)
    module = TorchEagle1(hf, family, fc_bias, input_norm).eval()
    _perturb(module)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(dict(
        hf, architectures=[f"{family.capitalize()}ForCausalLM"], bias=fc_bias)))
    sd = {k: v.contiguous() for k, v in module.state_dict().items()}
    if fmt == "safetensors":
        save_file(sd, path / "model.safetensors")
    else:
        torch.save(sd, path / "pytorch_model.bin")
    return path, module


@pytest.fixture(scope="module")
def eagle1(tmp_path_factory):
    return make_eagle1(tmp_path_factory.mktemp("eagle1") / "src")


@pytest.fixture
def src1(eagle1, tmp_path):
    """A private copy of the EAGLE-1 folder that a test may damage."""
    return shutil.copytree(eagle1[0], tmp_path / "src")


def _random_inputs(width: int, n_feats: int = 1, seed: int = 1):
    rs = np.random.RandomState(seed)
    tokens = rs.randint(0, BASE["vocab_size"], (B, T))
    feats = [rs.randn(B, T, width).astype(np.float32) for _ in range(n_feats)]
    return tokens, feats


@pytest.mark.parametrize("family,fc_bias,input_norm,fmt", [
    ("llama", True, False, "safetensors"),  # EAGLE-1 as released
    ("llama", True, False, "bin"),
    ("qwen2", False, True, "safetensors"),  # q/k/v biases, no fc bias, input norm kept
])
def test_eagle1_numerics(tmp_path, family, fc_bias, input_norm, fmt):
    src, module = make_eagle1(tmp_path / "src", family, fc_bias, input_norm, fmt)
    assert is_eagle_folder(src) and not is_eagle3_folder(src)
    target = target_cfg(family)
    out = convert_eagle(src, tmp_path / "out", target_cfg=target, progress=False)
    cfg, params, meta = read_drafter(out, target)
    assert (cfg.fc_bias, cfg.input_norm) == (fc_bias, input_norm)
    assert cfg.target.rope_theta == 5000.0 and meta["source_format"] == "eagle"
    assert (params.fc_bias is None) != fc_bias
    assert (params.layers[0].attn_norm is None) != input_norm

    tokens, (feats,) = _random_inputs(BASE["hidden_size"])
    with torch.no_grad():
        want = module(torch.tensor(tokens), torch.tensor(feats)).numpy()
    embed = jnp.asarray(module.embed_tokens.weight.detach().numpy())
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    got, _ = drafter_hidden(params, cfg, embed, jnp.asarray(tokens), jnp.asarray(feats), pos,
                            init_drafter_cache(cfg, B, T))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


def test_eagle1_overwrite_and_dispatch(eagle1, tmp_path):
    out = convert_eagle_folder(eagle1[0], tmp_path / "out", progress=False)
    with pytest.raises(FileExistsError, match="already exists"):
        convert_eagle(eagle1[0], out, progress=False)
    assert convert_eagle(eagle1[0], out, overwrite=True, progress=False) == out


def test_eagle1_bfloat16_source(eagle1, tmp_path):
    """bf16 weights (as EAGLE releases them) read through ml_dtypes; bf16 output on request."""
    src = shutil.copytree(eagle1[0], tmp_path / "src")
    sd = {k: v.to(torch.bfloat16) for k, v in eagle1[1].state_dict().items()}
    save_file(sd, src / "model.safetensors")
    _, params, _ = read_drafter(convert_eagle(src, tmp_path / "a", progress=False))
    np.testing.assert_array_equal(np.asarray(params.fc), sd["fc.weight"].float().numpy().T)
    _, params, _ = read_drafter(convert_eagle(src, tmp_path / "b", dtype="bfloat16",
                                              progress=False))
    assert str(params.fc.dtype) == "bfloat16"


def test_detector_ignores_a_full_hf_model(tiny_llama, eagle1):
    assert eagle_kind(tiny_llama) is None and not is_eagle_folder(tiny_llama)
    assert eagle_kind(eagle1[0]) == "eagle"
    assert eagle_kind(eagle1[0] / "config.json") is None


@pytest.mark.parametrize("damage,match", [
    (lambda s: s.pop("layers.0.mlp.up_proj.weight"), r"missing.*mlp\.up_proj"),
    (lambda s: s.update({"layers.0.self_attn.q_norm.weight": np.ones(16, np.float32)}),
     r"unexpected.*q_norm"),
    (lambda s: s.update({"fc.weight": np.zeros((64, 96), np.float32)}),
     r"shape mismatch.*fc\.weight: \(64, 96\) != \(64, 128\)"),
    (lambda s: s.update({"embed_tokens.weight": np.zeros((300, 64), np.float32)}),
     r"shape mismatch.*embed_tokens"),
    (lambda s: s.update({"layers.1.post_attention_layernorm.weight": np.ones(64, np.float32)}),
     r"decoder layers \[0, 1\].*exactly one"),
])
def test_eagle1_refuses_bad_tensors(src1, tmp_path, damage, match):
    edit_tensors(src1, damage)
    with pytest.raises(CheckpointError, match=match):
        convert_eagle(src1, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_eagle1_refuses_two_layers_and_bias_flag(src1, tmp_path):
    edit_config(src1, num_hidden_layers=2)
    with pytest.raises(CheckpointError, match="num_hidden_layers=2"):
        convert_eagle(src1, tmp_path / "out", progress=False)
    edit_config(src1, num_hidden_layers=1, bias=False)
    with pytest.raises(CheckpointError, match="bias=False but fc.bias is present"):
        convert_eagle(src1, tmp_path / "out", progress=False)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_eagle1_refuses_truncated_file(tmp_path, fmt):
    src, _ = make_eagle1(tmp_path / "src", fmt=fmt)
    f = src / ("model.safetensors" if fmt == "safetensors" else "pytorch_model.bin")
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        convert_eagle(src, tmp_path / "out", progress=False)


def test_eagle1_bin_without_torch_says_how_to_fix(tmp_path, monkeypatch):
    src, _ = make_eagle1(tmp_path / "src", fmt="bin")
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    assert is_eagle_folder(src)  # guessed from config.json
    with pytest.raises(CheckpointError, match=r"pip install torch.*model\.safetensors"):
        convert_eagle(src, tmp_path / "out", progress=False)


@pytest.mark.parametrize("target,match", [
    (target_cfg(hidden_size=128), "hidden_size: EAGLE drafter 64 vs target 128"),
    (target_cfg(vocab_size=512), "vocab_size: EAGLE drafter 256 vs target 512"),
    (target_cfg("qwen3", head_dim=16), "model_type: EAGLE drafter llama vs target qwen3"),
])
def test_eagle1_refuses_other_target(eagle1, tmp_path, target, match):
    with pytest.raises(DrafterMismatchError, match=match):
        convert_eagle(eagle1[0], tmp_path / "out", target_cfg=target, progress=False)


def test_missing_weights_and_config(tmp_path):
    (tmp_path / "a").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        convert_eagle(tmp_path / "a", tmp_path / "out", progress=False)
    (tmp_path / "a" / "config.json").write_text(json.dumps(EAGLE_BASE))
    with pytest.raises(CheckpointError, match="no model.safetensors or pytorch_model.bin"):
        convert_eagle(tmp_path / "a", tmp_path / "out", progress=False)


# --------------------------------------------------------------------------- EAGLE-3


class Midlayer(nn.Module):
    """cnets.py's LlamaDecoderLayeremb: attention over [input_layernorm(emb); hidden_norm(h)]."""

    def __init__(self, config):
        super().__init__()
        d, dh = config.hidden_size, config.head_dim
        self.self_attn = ml.LlamaAttention(config, layer_idx=0)
        # q/k/v read the 2d-wide concatenation; o_proj maps back to d.
        for name, heads in (("q_proj", config.num_attention_heads),
                            ("k_proj", config.num_key_value_heads),
                            ("v_proj", config.num_key_value_heads)):
            setattr(self.self_attn, name, nn.Linear(2 * d, heads * dh, bias=False))
        self.mlp = ml.LlamaMLP(config)
        eps = config.rms_norm_eps
        self.hidden_norm = ml.LlamaRMSNorm(d, eps)
        self.input_layernorm = ml.LlamaRMSNorm(d, eps)
        self.post_attention_layernorm = ml.LlamaRMSNorm(d, eps)

    def forward(self, emb, hidden, mask, position_embeddings):
        residual = hidden
        h = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        h, _ = self.self_attn(h, position_embeddings=position_embeddings, attention_mask=mask)
        h = residual + h
        return h + self.mlp(self.post_attention_layernorm(h))


class TorchEagle3(nn.Module):
    """cnets.py's Model: fc over 3 target layers, midlayer, norm, own lm_head, d2t / t2d."""

    def __init__(self, hf: dict, d2t: torch.Tensor, t2d: torch.Tensor):
        super().__init__()
        config = transformers.LlamaConfig(**hf, attn_implementation="eager")
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.lm_head = nn.Linear(d, hf["draft_vocab_size"], bias=False)
        self.midlayer = Midlayer(config)
        self.fc = nn.Linear(3 * hf.get("target_hidden_size", d), d, bias=False)
        self.norm = ml.LlamaRMSNorm(d, config.rms_norm_eps)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        self.rotary = ml.LlamaRotaryEmbedding(config)

    def forward(self, tokens, taps):
        hidden = self.fc(torch.cat(taps, dim=-1))
        pos = torch.arange(tokens.shape[1])[None].expand(tokens.shape)
        out = self.midlayer(self.embed_tokens(tokens), hidden, _causal(tokens.shape[1]),
                            self.rotary(hidden, pos))
        logits = self.lm_head(self.norm(out))
        top = logits.argmax(-1)
        return out, logits, top + self.d2t[top]  # EAGLE's draft id -> target id


VD = 48  # draft vocabulary


def make_eagle3(path, seed=0, draft_vocab=VD, **hf_changes):
    """Write an HF-form EAGLE-3 folder; returns (path, torch module, state dict).

    ``hf_changes`` edit its config.json (e.g. ``vocab_size``: the target's vocabulary).
    """
    torch.manual_seed(seed)
    v = hf_changes.get("vocab_size", BASE["vocab_size"])
    used = np.sort(np.random.RandomState(seed).choice(v, draft_vocab, replace=False))
    d2t = torch.tensor(used - np.arange(draft_vocab), dtype=torch.long)  # EAGLE's construction
    t2d = torch.tensor(np.isin(np.arange(v), used))
    hf = dict(EAGLE_BASE, model_type="llama", draft_vocab_size=draft_vocab, **hf_changes)
    module = TorchEagle3(hf, d2t, t2d).eval()
    _perturb(module)
    path.mkdir(parents=True)
    config = dict(hf, architectures=["LlamaForCausalLMEagle3"])  # as EAGLE-3 ships it
    (path / "config.json").write_text(json.dumps(config))
    sd = {k: v.contiguous() for k, v in module.state_dict().items()}
    save_file(sd, path / "model.safetensors")
    return path, module, {k: v.numpy() for k, v in sd.items()}


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory):
    return make_eagle3(tmp_path_factory.mktemp("eagle3") / "src")


@pytest.fixture
def src3(eagle3, tmp_path):
    return shutil.copytree(eagle3[0], tmp_path / "src")


@pytest.mark.parametrize("own_width", [None, 32])
def test_eagle3_numerics_and_round_trip(eagle3, tmp_path, own_width):
    if own_width is None:
        src, module, state = eagle3
    else:  # a drafter narrower than the target carries its own embedding
        src, module, state = make_eagle3(tmp_path / "src", hidden_size=own_width,
                                         target_hidden_size=BASE["hidden_size"])
    assert is_eagle3_folder(src) and not is_eagle_folder(src)
    target = target_cfg()
    out = convert_eagle_folder(src, tmp_path / "out", target_cfg=target, progress=False)
    cfg, p, meta = read_eagle3(out, target)
    assert cfg.draft_vocab_size == VD and cfg.own_embed == (own_width is not None)
    assert cfg.layer.rope_theta == 5000.0 and meta["vocab_map"] == "d2t"

    tokens, taps = _random_inputs(BASE["hidden_size"], n_feats=3)
    with torch.no_grad():
        h_want, logits_want, top_want = module(torch.tensor(tokens),
                                               [torch.tensor(x) for x in taps])
    embed = None if cfg.own_embed else jnp.asarray(module.embed_tokens.weight.detach().numpy())
    feats = eagle3_fuse(p, tuple(jnp.asarray(x) for x in taps))
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    h, _ = eagle3_hidden(p, cfg, embed, jnp.asarray(tokens), feats, pos,
                         init_eagle3_cache(cfg, B, T))
    ids, logits = eagle3_candidates(p, cfg, h)
    np.testing.assert_allclose(np.asarray(h), h_want.numpy(), atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits), logits_want.numpy(), atol=1e-5)
    assert ids.shape == logits.shape == (B, T, VD)
    np.testing.assert_array_equal(ids[0, 0], np.arange(VD) + state["d2t"])
    got_top = np.take_along_axis(np.asarray(ids), np.asarray(logits).argmax(-1)[..., None], -1)
    np.testing.assert_array_equal(got_top[..., 0], top_want.numpy())

    # Export back to HF names: exactly the input, minus the embedding copy it never stores.
    exported = export_eagle3_state(p)
    if not cfg.own_embed:
        state = {k: v for k, v in state.items() if k != "embed_tokens.weight"}
    assert exported.keys() == state.keys()
    for k, v in state.items():
        assert exported[k].dtype == v.dtype, k
        np.testing.assert_array_equal(exported[k], v, err_msg=k)


def test_eagle3_incremental_drafting_matches_one_shot(eagle3, tmp_path):
    """Cached chunks (prefill, then one row at a time) equal one pass over the block."""
    out = convert_eagle3(eagle3[0], tmp_path / "out", progress=False)
    cfg, p, _ = read_eagle3(out)
    tokens, (feats,) = _random_inputs(BASE["hidden_size"], seed=3)
    embed = jnp.asarray(eagle3[1].embed_tokens.weight.detach().numpy())
    tokens, feats = jnp.asarray(tokens), jnp.asarray(feats)
    hidden = jax.jit(eagle3_hidden, static_argnums=1)  # op-by-op dispatch is slow on CPU
    full, _ = hidden(p, cfg, embed, tokens, feats, jnp.broadcast_to(jnp.arange(T), (B, T)),
                            init_eagle3_cache(cfg, B, T))
    cache, parts = init_eagle3_cache(cfg, B, 8), []
    for s, e in ((0, 4), (4, 5), (5, 6), (6, 7)):
        pos = jnp.broadcast_to(jnp.arange(s, e), (B, e - s))
        h, cache = hidden(p, cfg, embed, tokens[:, s:e], feats[:, s:e], pos, cache)
        cache = dataclasses.replace(cache, lengths=cache.lengths + (e - s))
        parts.append(h)
    np.testing.assert_allclose(np.concatenate(parts, 1), np.asarray(full), atol=1e-5)


def test_eagle3_tap_layers():
    assert eagle3_tap_layers(32) == (1, 15, 28)  # EAGLE reads the inputs of layers 2, 16, 29
    with pytest.raises(ValueError, match="at least 8 layers"):
        eagle3_tap_layers(4)


@pytest.mark.parametrize("target,match", [
    (target_cfg(hidden_size=128), "hidden_size: EAGLE-3 drafter fuses 64-wide features vs "
                                  "target 128"),
    (target_cfg(vocab_size=512), "vocab_size: EAGLE-3 drafter 256 vs target 512"),
])
def test_eagle3_refuses_other_target(eagle3, tmp_path, target, match):
    with pytest.raises(DrafterMismatchError, match=match):
        convert_eagle3(eagle3[0], tmp_path / "out", target_cfg=target, progress=False)
    out = convert_eagle3(eagle3[0], tmp_path / "ok", progress=False)
    with pytest.raises(DrafterMismatchError, match=match):
        read_eagle3(out, target)


def _set_d2t(s, i, target_id):
    s["d2t"][i] = target_id - i


@pytest.mark.parametrize("damage,match", [
    (lambda s: _set_d2t(s, VD - 1, BASE["vocab_size"]),
     rf"draft id {VD - 1} to target id 256, outside the target vocabulary \[0, 256\)"),
    (lambda s: _set_d2t(s, 0, -1), "draft id 0 to target id -1, outside"),
    (lambda s: s["t2d"].__setitem__(int(np.flatnonzero(~s["t2d"])[0]), True),
     "t2d disagrees with d2t at 1 target ids"),
    (lambda s: _set_d2t(s, 1, 0 + s["d2t"][0]), "several draft ids to target id"),
    (lambda s: s.pop("d2t"), r"missing.*'d2t'"),
    (lambda s: s.update({"lm_head.weight": np.zeros((VD + 1, 64), np.float32)}),
     r"lm_head\.weight: \(49, 64\) != \(48, 64\)"),
])
def test_eagle3_refuses_bad_vocab_map(src3, tmp_path, damage, match):
    edit_tensors(src3, damage)
    with pytest.raises(CheckpointError, match=match):
        convert_eagle3(src3, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_eagle3_full_draft_vocab_is_identity(tmp_path):
    """EAGLE drops d2t / t2d when Vd == V; so does the import (identity map)."""
    src, module, _ = make_eagle3(tmp_path / "src")
    edit_config(src, draft_vocab_size=BASE["vocab_size"])
    edit_tensors(src, lambda s: (s.pop("d2t"), s.pop("t2d"), s.update(
        {"lm_head.weight": np.ones((BASE["vocab_size"], 64), np.float32)})))
    cfg, p, meta = read_eagle3(convert_eagle3(src, tmp_path / "out", progress=False))
    assert meta["vocab_map"] == "identity" and bool(np.all(np.asarray(p.t2d)))
    ids, _ = eagle3_candidates(p, cfg, jnp.zeros((1, 64)))
    np.testing.assert_array_equal(ids[0], np.arange(BASE["vocab_size"]))


def test_kind_mismatch_is_explained(eagle1, eagle3, tmp_path):
    with pytest.raises(CheckpointError, match="EAGLE-3 drafter"):
        convert_eagle(eagle3[0], tmp_path / "a", progress=False)
    with pytest.raises(CheckpointError, match="EAGLE-1/2 drafter"):
        convert_eagle3(eagle1[0], tmp_path / "b", progress=False)
