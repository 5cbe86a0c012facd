"""Read llama.cpp GGUF checkpoints into Hugging Face names, layout and config.

:func:`read_gguf` returns what an HF checkpoint of the same model holds: the ``config.json``
dict and a float32 state dict keyed by transformers' parameter names, every matrix in
PyTorch's ``[out_features, in_features]`` layout. Quantized tensors are dequantized with
gguf-py, and the output matches ``transformers``' own GGUF loader tensor for tensor.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tqdm.auto import tqdm


class GGUFError(ValueError):
    """A GGUF file that is missing, unreadable, or describes a model specjax cannot run."""


# general.architecture -> (HF model_type, HF architectures[0]).
_ARCHS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Per-block GGUF tensor stem -> HF module under model.layers.{i}.
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 has four norms per block; llama.cpp's ``ffn_norm`` is its pre-feed-forward norm.
_GEMMA3_BLOCK = dict(_BLOCK, ffn_norm="pre_feedforward_layernorm",
                     post_attention_norm="post_attention_layernorm",
                     post_ffw_norm="post_feedforward_layernorm")
_REQUIRED_BLOCK = ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                   "ffn_gate", "ffn_up", "ffn_down"]
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_MISSING = object()


def _check_file(path: str | os.PathLike) -> Path:
    """Cheap checks before parsing: ``path`` exists, is a file, and starts with GGUF's magic."""
    p = Path(path)
    if p.is_dir():
        raise GGUFError(f"{str(p)!r} is a directory; pass the .gguf file inside it.")
    if not p.is_file():
        raise GGUFError(f"GGUF file {str(p)!r} not found. Check the path.")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(
            f"{str(p)!r} is not a GGUF file: it starts with {magic!r}, not b'GGUF'. Pass a "
            "llama.cpp .gguf checkpoint (safetensors/PyTorch checkpoints use another converter)."
        )
    return p


def _open(path: str | os.PathLike) -> gguf.GGUFReader:
    """Open ``path`` with gguf-py, turning every way it can fail into a :class:`GGUFError`."""
    p = _check_file(path)
    try:
        reader = gguf.GGUFReader(p)
    except Exception as e:  # gguf-py raises ValueError/IndexError/KeyError/... on bad bytes.
        raise GGUFError(
            f"{str(p)!r} is truncated or corrupt and gguf could not parse it "
            f"({type(e).__name__}: {e}). Re-download or re-export the file."
        ) from e
    size = p.stat().st_size
    short = [t.name for t in reader.tensors if t.data_offset + t.n_bytes > size]
    if short:
        raise GGUFError(
            f"{str(p)!r} is truncated: {len(short)} tensors (e.g. {short[0]}) end past its "
            f"{size} bytes. Re-download or re-export the file."
        )
    return reader


def _meta(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """Value of metadata ``key`` as a Python scalar/str/list; ``default`` or an error if absent."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise GGUFError(f"GGUF metadata key {key!r} is missing; the file is incomplete.")
        return default
    return field.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation; ``w`` is ``[n_head * head_dim, ...]``.

    HF Llama applies RoPE to the two *halves* of each head (rotate_half), while llama.cpp
    rotates *adjacent pairs*. llama.cpp's convert script therefore reorders each head's rows
    from ``[x_0..x_{d/2-1}, y_0..y_{d/2-1}]`` to ``[x_0, y_0, x_1, y_1, ...]`` (reshape to
    ``[n_head, 2, d/2]`` and swap the last two axes). This is its inverse, as in transformers'
    ``LlamaTensorProcessor``. Qwen2/Qwen3 GGUFs use NEOX-style RoPE and are not permuted.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_factors(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """Per-frequency divisors ``[head_dim // 2]`` of Llama-3 RoPE scaling (llama.cpp's formula)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    orig, lo, hi = (scaling[k] for k in ("original_max_position_embeddings",
                                         "low_freq_factor", "high_freq_factor"))
    smooth = np.clip((orig / wavelen - lo) / (hi - lo), 0.0, 1.0)
    return 1.0 / ((1 - smooth) / scaling["factor"] + smooth)


def _rope_scaling(reader: gguf.GGUFReader, arch: str, head_dim: int, theta: float) -> dict | None:
    """HF ``rope_scaling`` from GGUF metadata, or from a Llama-3 ``rope_freqs`` tensor."""
    kind = _meta(reader, f"{arch}.rope.scaling.type", "none")
    factor = _meta(reader, f"{arch}.rope.scaling.factor", 1.0)
    orig = _meta(reader, f"{arch}.rope.scaling.original_context_length", None)
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        # llama.cpp stores Llama-3 scaling only as this tensor of per-frequency divisors, not as
        # metadata. Recover HF's parameters: the factor is the largest divisor and the rest are
        # the Llama-3 defaults (which llama.cpp's converter also assumes); check they reproduce it.
        stored = gguf.quants.dequantize(freqs.data, freqs.tensor_type).reshape(-1)
        if np.all(stored == 1.0):
            return None
        scaling = {"rope_type": "llama3", "factor": float(stored.max()), "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": int(orig or 8192)}
        expect = _llama3_factors(head_dim, theta, scaling)
        if expect.shape != stored.shape or not np.allclose(expect, stored, rtol=1e-4):
            raise GGUFError(
                "rope_freqs.weight does not match Llama-3 RoPE scaling with default parameters "
                f"{scaling}; this RoPE variant is not supported."
            )
        return scaling
    if kind == "none" or factor == 1.0:
        return None
    scaling = {"rope_type": kind, "factor": float(factor)}
    if orig is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    return scaling


def read_gguf(
    path: str | os.PathLike, progress: bool = True
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read a llama/qwen2/qwen3/gemma3 GGUF file as an HF ``(config_dict, state_dict)`` pair.

    Gemma 3: llama.cpp stores every norm weight as ``1 + w``; this returns HF's ``w`` (as
    transformers' GGUF loader does), and the config llama.cpp assumes but does not write:
    a global layer every sixth (``sliding_window_pattern`` 6), local RoPE base 10000.

    Args:
        path: the ``.gguf`` file.
        progress: show a tqdm bar while dequantizing tensors.

    Returns:
        ``hf_config``: the dict of the equivalent transformers ``config.json``.
        ``state``: HF name -> float32 array in PyTorch layout, e.g.
        ``model.embed_tokens.weight`` ``[vocab, hidden]``, ``...q_proj.weight``
        ``[heads * head_dim, hidden]``, ``...down_proj.weight`` ``[hidden, intermediate]``,
        norms ``[hidden]`` (or ``[head_dim]`` for Qwen3's q_norm/k_norm). ``lm_head.weight``
        ``[vocab, hidden]`` is present only when the embeddings are untied.

    Raises:
        GGUFError: missing/non-GGUF/truncated file, unsupported architecture, missing or
            unexpected tensors.
    """
    reader = _open(path)
    arch = _meta(reader, "general.architecture")
    if arch not in _ARCHS:
        raise GGUFError(
            f"GGUF architecture {arch!r} is not supported; specjax reads "
            f"{', '.join(_ARCHS)} GGUF files. Use a checkpoint of a supported model family."
        )
    model_type, hf_arch = _ARCHS[arch]
    tensors = {t.name: t for t in reader.tensors}
    n_layers = _meta(reader, f"{arch}.block_count")
    n_heads = _meta(reader, f"{arch}.attention.head_count")
    n_kv = _meta(reader, f"{arch}.attention.head_count_kv", n_heads)

    block = _REQUIRED_BLOCK + (["attn_q_norm", "attn_k_norm"] if arch in ("qwen3", "gemma3")
                               else [])
    block += ["post_attention_norm", "post_ffw_norm"] if arch == "gemma3" else []
    block_names = _GEMMA3_BLOCK if arch == "gemma3" else _BLOCK
    required = ["token_embd.weight", "output_norm.weight"]
    required += [f"blk.{i}.{s}.weight" for i in range(n_layers) for s in block]
    if arch == "qwen2":
        qkv = ("attn_q", "attn_k", "attn_v")
        required += [f"blk.{i}.{s}.bias" for i in range(n_layers) for s in qkv]
    missing = [n for n in required if n not in tensors]
    if missing:
        raise GGUFError(
            f"GGUF {arch} file lacks {len(missing)} required tensors, e.g. {missing[:4]}; "
            "it is incomplete or was written by an incompatible converter."
        )

    names: dict[str, str] = {}  # GGUF tensor name -> HF name
    unexpected = []
    for name in tensors:
        m = _BLOCK_RE.fullmatch(name)
        if name in _TOP_LEVEL:
            names[name] = _TOP_LEVEL[name]
        elif m and int(m[1]) < n_layers and m[2] in block_names:
            names[name] = f"model.layers.{m[1]}.{block_names[m[2]]}.{m[3]}"
        elif name != "rope_freqs.weight":  # Consumed into rope_scaling below.
            unexpected.append(name)
    if unexpected:
        raise GGUFError(
            f"GGUF {arch} file has tensors specjax does not know how to load, e.g. "
            f"{unexpected[:4]}; the model uses features specjax does not implement."
        )

    q_rows = int(tensors["blk.0.attn_q.weight"].shape[-1])  # GGUF shapes are [in, out].
    # llama writes rope.dimension_count == head_dim; Qwen3 writes attention.key_length.
    head_dim = _meta(reader, f"{arch}.attention.key_length", None) or q_rows // n_heads
    if head_dim * n_heads != q_rows:
        raise GGUFError(f"attn_q has {q_rows} rows, not heads {n_heads} x head_dim {head_dim}.")
    theta = float(_meta(reader, f"{arch}.rope.freq_base", 10000.0))
    embed_shape = [int(d) for d in reversed(tensors["token_embd.weight"].shape)]
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [hf_arch],
        "vocab_size": embed_shape[0],
        "hidden_size": _meta(reader, f"{arch}.embedding_length"),
        "intermediate_size": _meta(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": int(head_dim),
        "rms_norm_eps": float(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "max_position_embeddings": _meta(reader, f"{arch}.context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        "bos_token_id": _meta(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _meta(reader, "tokenizer.ggml.eos_token_id", None),
    }
    if (pad := _meta(reader, "tokenizer.ggml.padding_token_id", None)) is not None:
        config["pad_token_id"] = pad
    if arch == "llama" and "blk.0.attn_q.bias" in tensors:
        config["attention_bias"] = True
    if (scaling := _rope_scaling(reader, arch, int(head_dim), theta)) is not None:
        config["rope_scaling"] = scaling
    if arch == "gemma3":
        del config["hidden_act"]
        config |= {
            "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": _meta(reader, f"{arch}.attention.sliding_window"),
            # llama.cpp hard-codes these for gemma3 instead of writing them: every sixth
            # layer global, local RoPE base 10000, and the attention scale 1/sqrt(head_dim)
            # (all Gemma 3 sizes but 27B, whose query_pre_attn_scalar is d / heads).
            "sliding_window_pattern": 6,
            "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": int(head_dim),
        }

    state: dict[str, np.ndarray] = {}
    for name, hf_name in tqdm(names.items(), desc="Dequantizing GGUF", disable=not progress):
        t = tensors[name]
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise GGUFError(
                f"tensor {name} uses quantization {t.tensor_type.name}, which gguf-py cannot "
                f"dequantize ({e}). Upgrade the gguf package or requantize the file."
            ) from e
        # GGUF lists dims fastest-first ([in, out]); numpy/PyTorch order is the reverse.
        w = np.array(w, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        if arch == "llama" and ".attn_q." in name:
            w = _unpermute(w, n_heads)
        elif arch == "llama" and ".attn_k." in name:
            w = _unpermute(w, n_kv)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's 1 + w; HF (and this state) hold w
        state[hf_name] = w
    return config, state


def save_gguf_tokenizer(path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Write the GGUF's tokenizer as HF files (tokenizer.json, tokenizer_config.json, chat
    template) to ``out_dir``.

    The metadata is read with gguf-py and handed to transformers' GGUF tokenizer
    builders. ``AutoTokenizer.from_pretrained(gguf_file=...)`` would do the same
    but its GGUF reader imports torch, which is only a test dependency here.
    """
    from transformers import PreTrainedTokenizerFast

    try:  # where transformers 5.23 (the CPU pin) keeps them
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:  # 5.17 (the GPU machines' image) keeps them in integrations.ggml
        from transformers.integrations.ggml import (  # type: ignore[no-redef]
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )

    reader = _open(path)
    arch = _meta(reader, "general.architecture")
    grouped = {
        group: {name: _meta(reader, f"tokenizer.{key}") for key, name in renames.items()
                if f"tokenizer.{key}" in reader.fields}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if "tokens" not in tokenizer:
        raise GGUFError(f"{path}: no tokenizer.ggml.tokens metadata; the file carries no "
                        "tokenizer. Provide the model's HF tokenizer files instead.")
    if tokenizer.get("tokenizer_type") == "llama":
        # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
        config.setdefault("add_bos_token", True)
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = _meta(reader, f"tokenizer.ggml.{key}", None)
        if token_id is not None:
            config[name] = tokenizer["tokens"][int(token_id)]
    try:
        backend, extra = convert_gguf_tokenizer(arch, tokenizer)
        # The builder's own settings win: transformers 5.17's repeat unk_token.
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, **(config | extra))
    except Exception as e:
        raise GGUFError(
            f"transformers could not build a tokenizer from {str(path)!r} "
            f"({type(e).__name__}: {e}). Provide the model's HF tokenizer files instead."
        ) from e
    tok.save_pretrained(str(out_dir))
