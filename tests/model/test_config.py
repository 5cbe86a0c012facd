"""``ModelConfig`` from an HF ``config.json`` (Llama / Qwen2 / Qwen3) and from specjax's own
manifest: what each family turns on, and a refusal naming the field for each thing specjax
cannot run or cannot read. (Gemma 3's fields are in test_gemma3.py.)"""

from __future__ import annotations

import math

import pytest

from specjax.config import ModelConfig, RopeScaling, UnsupportedModelError

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256,
         "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
         "rope_theta": 5e5, "max_position_embeddings": 512, "bos_token_id": 1,
         "eos_token_id": [2, 3], "hidden_act": "silu", "tie_word_embeddings": True}


def _hf(**changes):
    d = dict(LLAMA)
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


def test_llama_fields():
    cfg = ModelConfig.from_hf(LLAMA)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.q_per_kv == 2 and cfg.eos_token_ids == (2, 3) and cfg.tie_word_embeddings
    assert not cfg.attention_bias and not cfg.qk_norm and cfg.rope_scaling is None
    assert cfg.attn_scale == pytest.approx(16 ** -0.5) and not cfg.is_sliding(0)
    assert ModelConfig.from_json(cfg.to_json()) == cfg


def test_family_defaults():
    # No num_key_value_heads: multi-head attention; no head_dim: hidden / heads; one eos id.
    cfg = ModelConfig.from_hf(_hf(num_key_value_heads=None, eos_token_id=7))
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 16 and cfg.eos_token_ids == (7,)
    assert ModelConfig.from_hf(_hf(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
                               ).attention_bias  # Qwen2's q/k/v projections carry biases
    q3 = ModelConfig.from_hf(_hf(model_type="qwen3", architectures=["Qwen3ForCausalLM"],
                                 head_dim=32))
    assert q3.qk_norm and not q3.attention_bias and q3.head_dim == 32
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = ModelConfig.from_hf(_hf(rope_scaling=rope))
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert ModelConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("changes, exc, message", [
    (dict(model_type="gpt2"), UnsupportedModelError, "model_type 'gpt2'"),
    (dict(model_type="gemma3"), UnsupportedModelError, "multimodal Gemma 3"),
    (dict(architectures="LlamaForCausalLM"), ValueError, "architectures must be a list"),
    (dict(architectures=["LlamaModel"]), UnsupportedModelError, "not decoder-only"),
    (dict(hidden_act="gelu"), UnsupportedModelError, "hidden_act 'gelu'"),
    (dict(mlp_bias=True), UnsupportedModelError, "mlp_bias"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), UnsupportedModelError,
     "rope_type 'yarn'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), ValueError,
     "lacks the required field 'low_freq_factor'"),
    (dict(num_attention_heads=None), ValueError,
     "lacks the required field 'num_attention_heads'"),
    (dict(hidden_size="64"), ValueError, "wrong type"),
    (dict(num_hidden_layers=0), ValueError, "num_layers must be a positive integer"),
    (dict(vocab_size=True), ValueError, "vocab_size must be a positive integer"),
    (dict(num_attention_heads=6, num_key_value_heads=4, head_dim=16), ValueError,
     "num_heads=6 is not a multiple of num_kv_heads=4"),
    (dict(rms_norm_eps=-1e-5), ValueError, "rms_norm_eps must be a finite number > 0"),
    (dict(rope_theta=math.inf), ValueError, "rope_theta must be a finite number > 0"),
    (dict(eos_token_id="</s>"), ValueError, "eos_token_id must be an int or a list of ints"),
    (dict(eos_token_id=[2, None]), ValueError, "eos_token_id must be an int"),
])
def test_hf_configs_specjax_refuses(changes, exc, message):
    with pytest.raises(exc, match=message):
        ModelConfig.from_hf(_hf(**changes))


def test_qwen_sliding_window_is_refused():
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        ModelConfig.from_hf(_hf(model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                                use_sliding_window=True))


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(heads=4), r"unknown fields \['heads'\]"),
    (lambda d: d.pop("vocab_size"), r"lacks the required fields \['vocab_size'\]"),
    (lambda d: d.update(rope_scaling=[8.0]), "rope_scaling must be an object or null"),
    (lambda d: d.update(rope_scaling={"factor": 8.0}),
     r"rope_scaling lacks the required fields"),
    (lambda d: d.update(eos_token_ids=[True]), "eos_token_ids must be a list of ints"),
    (lambda d: d.update(layer_types="full_attention"), "layer_types must be a list of strings"),
    (lambda d: d.update(layer_types=["full_attention"]), "layer_types has 1 entries for "
     "num_layers=2"),
    (lambda d: d.update(hidden_act="relu"), "hidden_act 'relu'"),
    (lambda d: d.update(query_pre_attn_scalar=0), "query_pre_attn_scalar must be a finite"),
])
def test_manifest_configs_specjax_refuses(edit, message):
    d = ModelConfig.from_hf(LLAMA).to_json()
    edit(d)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_json(d)
    with pytest.raises(ValueError, match="config must be a JSON object"):
        ModelConfig.from_json([d])
