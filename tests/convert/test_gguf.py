"""GGUF reader: parity with transformers' GGUF loader, synthetic round trips, refusals."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from specjax.convert.gguf import GGUFError, read_gguf, save_gguf_tokenizer
from specjax.defaults import smollm2_gguf_path
from specjax.tokenizer import TokenizerError
from tests.tiny import make_hf_model

CONFIG_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
               "tie_word_embeddings", "bos_token_id", "eos_token_id", "hidden_act", "rms_norm_eps"]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return smollm2_gguf_path()


@pytest.fixture(scope="module")
def smollm2_read(smollm2):
    return read_gguf(smollm2, progress=False)


@pytest.fixture(scope="module")
def hf_reference(smollm2_hf):
    """transformers' own GGUF load of SmolLM2: (config, {name: float32 array})."""
    return smollm2_hf.config, {k: v.numpy() for k, v in smollm2_hf.state_dict().items()}


def test_smollm2_matches_transformers(smollm2_read, hf_reference):
    config, state = smollm2_read
    hf_config, hf_state = hf_reference
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    for key in CONFIG_KEYS:
        assert config[key] == getattr(hf_config, key), key
    assert config["rope_theta"] == hf_config.rope_parameters["rope_theta"]
    assert "rope_scaling" not in config
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"]
    # Tied: transformers lists lm_head.weight as an alias of the embedding; we leave it out.
    assert set(state) == set(hf_state) - {"lm_head.weight"}
    for name, ref in hf_state.items():
        if name in state:
            assert state[name].dtype == np.float32 and state[name].shape == ref.shape, name
            np.testing.assert_array_equal(state[name], ref, err_msg=name)


def test_smollm2_tokenizer(smollm2, tmp_path):
    save_gguf_tokenizer(smollm2, tmp_path)
    saved = AutoTokenizer.from_pretrained(tmp_path)
    ref = AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    text = "Speculative decoding drafts tokens, then verifies them: 123 ÄÖ 日本 🙂."
    assert saved(text)["input_ids"] == ref(text)["input_ids"]
    assert saved.decode(saved(text)["input_ids"]) == ref.decode(ref(text)["input_ids"])
    assert (saved.bos_token_id, saved.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    assert saved.chat_template and saved.chat_template == ref.chat_template
    msgs = [{"role": "user", "content": "Hi!"}]
    assert saved.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    )


def test_missing_and_non_gguf_files(tmp_path):
    with pytest.raises(GGUFError, match="not found"):
        read_gguf(tmp_path / "nope.gguf")
    with pytest.raises(GGUFError, match="directory"):
        read_gguf(tmp_path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf(junk)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf(tmp_path / "empty.gguf")
    with pytest.raises(GGUFError, match="not found"):
        save_gguf_tokenizer(tmp_path / "nope.gguf", tmp_path / "tok")


@pytest.mark.parametrize("fraction", ["1MB", "half"])
def test_truncated_gguf(smollm2, tmp_path, fraction):
    size = 2**20 if fraction == "1MB" else smollm2.stat().st_size // 2
    cut = tmp_path / "cut.gguf"
    with open(smollm2, "rb") as f:
        cut.write_bytes(f.read(size))
    with pytest.raises(GGUFError, match="truncated or corrupt|is truncated") as e:
        read_gguf(cut, progress=False)
    assert "Re-download" in str(e.value)


# ---------------------------------------------------------------- synthetic GGUF files


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (HF rotate_half -> pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def _write_gguf(path: Path, model, arch: str, drop=(), rope_freqs=None, extra=None,
                skip_meta=()) -> Path:
    """Write ``model`` as llama.cpp's converter would: F32, GGUF names, Q/K permuted for llama.

    ``extra``: more tensors by GGUF name; ``skip_meta``: ``add_*`` calls left out (a file
    missing that metadata)."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    for name in skip_meta:
        setattr(w, name, lambda *a, **k: None)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)  # Gemma 3: per layer type
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    if arch == "llama":
        w.add_rope_dimension_count(c.head_dim)
    if arch in ("qwen3", "gemma3"):
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if arch == "gemma3":
        w.add_sliding_window(c.sliding_window)
    arch_enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    name_map = gguf.get_tensor_name_map(arch_enum, c.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{name_map.get_name(base)}.{suffix}"
        data = t.numpy()
        if arch == "llama" and "q_proj" in hf_name:
            data = _llama_cpp_permute(data, c.num_attention_heads)
        elif arch == "llama" and "k_proj" in hf_name:
            data = _llama_cpp_permute(data, c.num_key_value_heads)
        elif arch == "gemma3" and hf_name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp's Gemma converter stores 1 + w
        if name not in drop:
            w.add_tensor(name, np.ascontiguousarray(data))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    for name, data in (extra or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("llama", {"rope_parameters": LLAMA3_ROPE, "max_position_embeddings": 32768}),
        ("qwen2", {"tie_word_embeddings": True}),
        ("qwen3", {"head_dim": 8}),  # head_dim != hidden_size / heads.
    ],
)
def test_synthetic_round_trip(tmp_path, arch, overrides):
    model = make_hf_model(arch, **overrides)
    c = model.config
    rope_freqs = None
    if "rope_parameters" in overrides:
        # llama.cpp stores Llama-3 scaling as per-frequency divisors of the default inv_freq.
        d = c.head_dim
        base = 1.0 / LLAMA3_ROPE["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](c, "cpu")
        rope_freqs = (base / scaled).numpy().astype(np.float32)
    path = _write_gguf(tmp_path / f"{arch}.gguf", model, arch, rope_freqs=rope_freqs)
    config, state = read_gguf(path, progress=False)

    assert config["model_type"] == arch
    for key in CONFIG_KEYS:
        # Qwen2Config has no head_dim attribute; rms_norm_eps went through float32 in the file.
        ref = getattr(c, key, c.hidden_size // c.num_attention_heads)
        assert config[key] == (pytest.approx(ref, rel=1e-6) if key == "rms_norm_eps" else ref), key
    hf_state = {k: v.numpy() for k, v in model.state_dict().items()}
    if c.tie_word_embeddings:
        del hf_state["lm_head.weight"]
    assert set(state) == set(hf_state)
    for name, ref in hf_state.items():
        np.testing.assert_array_equal(state[name], ref, err_msg=name)
    if rope_freqs is not None:
        expect = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
        assert config["rope_scaling"] == pytest.approx(expect)
    else:
        assert "rope_scaling" not in config


def test_missing_tensor_and_unsupported_architecture(tmp_path):
    model = make_hf_model("llama")
    path = _write_gguf(tmp_path / "m.gguf", model, "llama", drop={"blk.1.ffn_up.weight"})
    with pytest.raises(GGUFError, match=r"lacks 1 required tensors.*blk\.1\.ffn_up\.weight"):
        read_gguf(path, progress=False)

    w = gguf.GGUFWriter(str(tmp_path / "gemma2.gguf"), "gemma2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="'gemma2' is not supported.*llama, qwen2, qwen3, gemma3"):
        read_gguf(tmp_path / "gemma2.gguf")


def test_gguf_features_specjax_lacks_are_refused_by_name(tmp_path):
    model = make_hf_model("llama")
    moe = _write_gguf(tmp_path / "moe.gguf", model, "llama",
                      extra={"blk.0.ffn_gate_exps.weight": np.zeros((2, 4, 4), np.float32)})
    with pytest.raises(GGUFError, match=r"does not know how to load.*ffn_gate_exps"):
        read_gguf(moe, progress=False)
    d = model.config.head_dim
    odd = _write_gguf(tmp_path / "rope.gguf", model, "llama",
                      rope_freqs=np.linspace(1.0, 3.0, d // 2).astype(np.float32))
    with pytest.raises(GGUFError, match="rope_freqs.weight does not match Llama-3"):
        read_gguf(odd, progress=False)
    headless = _write_gguf(tmp_path / "heads.gguf", model, "llama",
                           skip_meta=("add_head_count",))
    with pytest.raises(GGUFError, match="'llama.attention.head_count' is missing"):
        read_gguf(headless, progress=False)
    # These synthetic files carry no tokenizer: converting one asks for the HF files.
    plain = _write_gguf(tmp_path / "plain.gguf", model, "llama")
    with pytest.raises(GGUFError, match="no tokenizer.ggml.tokens.*HF tokenizer files"):
        save_gguf_tokenizer(plain, tmp_path / "tok")


def test_gemma3_round_trip(tmp_path):
    """A tiny Gemma 3 written with llama.cpp's conventions (norms stored as 1 + w, a global
    layer every sixth, attention scale 1/sqrt(head_dim)) reads back as transformers' state,
    and the converted model gives transformers' logits."""
    import jax.numpy as jnp

    from specjax.config import ModelConfig
    from specjax.convert.hf import params_from_hf_state
    from specjax.model import forward, init_cache

    model = make_hf_model("gemma3", num_hidden_layers=6, layer_types=None,
                          query_pre_attn_scalar=16)
    c = model.config
    assert c.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    config, state = read_gguf(_write_gguf(tmp_path / "g.gguf", model, "gemma3"), progress=False)
    assert config["model_type"] == "gemma3_text"
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert (config["sliding_window"], config["head_dim"]) == (c.sliding_window, c.head_dim)
    hf_state = {k: v.numpy() for k, v in model.state_dict().items()}
    assert set(state) == set(hf_state)
    for name, ref in hf_state.items():  # norms went through + 1 and - 1 in float32
        np.testing.assert_allclose(state[name], ref, atol=1e-6, rtol=0, err_msg=name)
    cfg = ModelConfig.from_hf(config)
    assert cfg.layer_types == tuple(c.layer_types) and cfg.attn_scale == 16 ** -0.5
    params = params_from_hf_state(cfg, state, "g.gguf")
    toks = np.random.RandomState(0).randint(3, 256, (1, 20))
    with torch.no_grad():
        ref = model(torch.tensor(toks)).logits.numpy()
    logits, _ = forward(params, cfg, jnp.asarray(toks), jnp.arange(20)[None],
                        init_cache(cfg, 1, 32))
    assert np.abs(np.asarray(logits) - ref).max() <= 1e-4


def test_convert_with_tokenizer_files_instead_of_the_metadata(smollm2, tmp_path):
    """``convert(..., tokenizer=DIR)``: for a transformers that cannot build the GGUF's
    tokenizer (5.17 on the GPU machines); the folder's files are taken as they are."""
    import specjax
    from specjax.checkpoint import CheckpointError

    tok = tmp_path / "tok"
    save_gguf_tokenizer(smollm2, tok)
    (tok / "tokenizer_config.json").write_text(
        (tok / "tokenizer_config.json").read_text().replace('"model_max_length"',
                                                            '"marker": 1, "model_max_length"'))
    out = specjax.convert(smollm2, tmp_path / "out", tokenizer=tok, progress=False)
    assert (out / "tokenizer_config.json").read_text() == (
        tok / "tokenizer_config.json").read_text()
    assert '"marker"' in (out / "tokenizer_config.json").read_text()
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        specjax.convert(smollm2, tmp_path / "o2", tokenizer=tmp_path, progress=False)
    assert not (tmp_path / "o2").exists()
    (tok / "tokenizer_config.json").write_text('{"auto_map": {"AutoTokenizer": "x.Tok"}}')
    with pytest.raises(TokenizerError, match="auto_map"):  # never code from a folder
        specjax.convert(smollm2, tmp_path / "o3", tokenizer=tok, progress=False)
