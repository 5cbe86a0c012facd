"""Dispatch a source checkpoint to its reader and write a specjax folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from specjax.checkpoint import CheckpointError, save_target, write_atomically
from specjax.config import ModelConfig
from specjax.convert.hf import load_hf_state, params_from_hf_state

# Tokenizer files copied verbatim from an HF folder when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
                   "generation_config.json")


def convert(src: str | Path, out: str | Path, *, overwrite: bool = False,
            dtype: str = "float32", progress: bool = True) -> Path:
    """Convert an HF Llama/Qwen folder, a ``.gguf`` file or an EAGLE drafter folder.

    Args:
      src: an HF folder (config.json + ``*.safetensors``), a GGUF file, or an
        EAGLE-1/2/3 drafter folder (``fc.*`` + one layer; see ``convert.eagle``).
      out: the folder to create; refused if it exists unless ``overwrite``.
      dtype: parameter dtype to store ("float32" or "bfloat16").
    Returns:
      The absolute path of the written folder. Nothing is left at ``out`` if
      conversion fails.
    """
    src = Path(src)
    np_dtype = np.dtype(dtype) if dtype != "bfloat16" else __import__("ml_dtypes").bfloat16
    if not src.exists():
        raise CheckpointError(f"{src}: no such file or folder")
    if src.is_dir():
        from specjax.convert.eagle import convert_eagle_folder, eagle_kind

        if eagle_kind(src) is not None:  # an EAGLE-1/2 or EAGLE-3 drafter, not a target
            return convert_eagle_folder(src, out, overwrite=overwrite, dtype=dtype,
                                        progress=progress)
        if not (src / "config.json").exists():
            raise CheckpointError(f"{src}: no config.json; expected an HF model folder "
                                  "(config.json + *.safetensors) or a .gguf file")
        hf_config = json.loads((src / "config.json").read_text())
        cfg = ModelConfig.from_hf(hf_config)
        state = load_hf_state(src, progress=progress)

        def write_tokenizer(tmp: Path) -> None:
            for name in TOKENIZER_FILES:
                if (src / name).exists():
                    shutil.copy(src / name, tmp / name)
    elif src.suffix == ".gguf":
        from specjax.convert.gguf import read_gguf, save_gguf_tokenizer

        hf_config, state = read_gguf(src, progress=progress)
        cfg = ModelConfig.from_hf(hf_config)

        def write_tokenizer(tmp: Path) -> None:
            save_gguf_tokenizer(src, tmp)
    else:
        raise CheckpointError(f"{src}: unrecognised source; expected an HF model folder or a "
                              ".gguf file")
    params = params_from_hf_state(cfg, state, str(src), dtype=np_dtype)
    del state

    def build(tmp: Path) -> None:
        write_tokenizer(tmp)
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=1))
        save_target(tmp, cfg, params, source=str(src.absolute()))

    return write_atomically(Path(out), build, overwrite=overwrite)
