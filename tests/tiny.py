"""Tiny random transformers checkpoints for parity tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
}

# A tiny Gemma 3: local and global layers, a window (8) shorter than the test prompts,
# distinct RoPE bases, and query_pre_attn_scalar != head_dim so a wrong scale shows.
GEMMA3 = dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default",
                                                     "rope_theta": 1e4}},
              bos_token_id=2, eos_token_id=1, pad_token_id=0)


def make_hf_model(family: str, seed: int = 0, **overrides):
    """A random-weight transformers model (fp32, eval mode)."""
    config_cls, model_cls = FAMILIES[family]
    kwargs = {**BASE, **(GEMMA3 if family == "gemma3" else {}), **overrides}
    if family == "qwen3":
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
    torch.manual_seed(seed)
    config = config_cls(**kwargs)
    model = model_cls(config).eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so the test
    # sees whether they are applied at all.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def make_hf_checkpoint(path: Path, family: str, seed: int = 0, **overrides) -> Path:
    """Save a tiny random model as an HF folder (config.json + safetensors)."""
    model = make_hf_model(family, seed, **overrides)
    model.save_pretrained(path)
    return Path(path)



def make_word_target(path: Path, family: str = "llama") -> Path:
    """A tiny random checkpoint with a word-level tokenizer and a ChatML template
    (``tests.vocab.conftest.toy_tokenizer``), converted into ``path / "sj"``: a target that
    takes text prompts, for commands and benchmarks that read text."""
    import specjax
    from tests.vocab.conftest import toy_tokenizer

    src = make_hf_checkpoint(Path(path) / "hf", family)
    toy_tokenizer().save_pretrained(src)
    return specjax.convert(src, Path(path) / "sj", progress=False)

def edit_config(src: Path, **changes) -> None:
    """Change fields of an HF folder's config.json in place (for refusal tests)."""
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (src / "config.json").write_text(json.dumps(cfg))


def edit_tensors(src: Path, fn) -> None:
    """Apply ``fn`` to the dict of an HF folder's model.safetensors, in place."""
    from safetensors.numpy import load_file, save_file

    f = src / "model.safetensors"
    state = load_file(f)
    fn(state)
    save_file(state, f)
