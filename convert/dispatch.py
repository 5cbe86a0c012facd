"""Dispatch a source checkpoint to its reader and write a specjax folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from specjax.checkpoint import (
    CheckpointError,
    check_output,
    clean_stale,
    output_lock,
    save_target,
    write_atomically,
)
from specjax.config import ModelConfig, UnsupportedModelError
from specjax.convert.hf import load_hf_state, params_from_hf_state
from specjax.tokenizer import check_folder, read_json

# Tokenizer files copied verbatim from an HF folder when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
                   "generation_config.json")


def convert(src: str | Path, out: str | Path, *, overwrite: bool = False,
            dtype: str = "float32", progress: bool = True,
            tokenizer: str | Path | None = None) -> Path:
    """Convert an HF Llama/Qwen folder, a ``.gguf`` file or an EAGLE drafter folder.

    OUT is checked before anything is read or dequantized, and its lock is held until the
    new folder is renamed into place (:func:`specjax.checkpoint.output_lock`): a second
    conversion to the same OUT meanwhile is refused. Never replaced: the source itself, a
    folder containing it or inside it, a file, or a non-empty folder specjax did not write.

    Args:
      src: an HF folder (config.json + ``*.safetensors``), a GGUF file, or an
        EAGLE-1/2/3 drafter folder (``fc.*`` + one layer; see ``convert.eagle``).
      out: the folder to create; refused if it exists unless ``overwrite``.
      dtype: parameter dtype to store ("float32" or "bfloat16").
      tokenizer: a folder of HF tokenizer files (``tokenizer.json`` at least) to use for a
        GGUF instead of the one its metadata describes, e.g. where the installed
        transformers cannot build that one.
    Returns:
      The absolute path of the written folder. Nothing is left at ``out`` if
      conversion fails.
    """
    if not isinstance(src, str | Path) or not isinstance(out, str | Path):
        raise TypeError("src and out must be str or Path")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    src = Path(src)
    if not src.exists():
        raise CheckpointError(f"{src}: no such file or folder")
    if tokenizer is not None:
        tokenizer = Path(tokenizer)
        if src.suffix != ".gguf":
            raise ValueError("tokenizer= is for a .gguf source; an HF folder brings its own")
        if not (tokenizer / "tokenizer.json").is_file():
            raise CheckpointError(f"{tokenizer}: no tokenizer.json; pass the folder of an HF "
                                  "checkpoint's tokenizer files")
        check_folder(tokenizer)  # a tokenizer that asks to run code is refused here too
    # Checked before the lock too, so a refused OUT leaves nothing behind (no lock file).
    check_output(Path(out), overwrite=overwrite, sources=[src])
    with output_lock(Path(out)) as out_path:
        clean_stale(out_path)  # may put back an OUT that a killed run had moved aside
        check_output(out_path, overwrite=overwrite, sources=[src])
        return _convert(src, out_path, overwrite=overwrite, dtype=dtype, progress=progress,
                        tokenizer=tokenizer)


def _copy_tokenizer(src: Path, tmp: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, tmp / name)


def _convert(src: Path, out: Path, *, overwrite: bool, dtype: str, progress: bool,
             tokenizer: Path | None = None) -> Path:
    np_dtype = np.dtype(dtype) if dtype != "bfloat16" else __import__("ml_dtypes").bfloat16
    if src.is_dir():
        from specjax.convert.eagle import convert_eagle_folder, eagle_kind

        if eagle_kind(src) is not None:  # an EAGLE-1/2 or EAGLE-3 drafter, not a target
            return convert_eagle_folder(src, out, overwrite=overwrite, dtype=dtype,
                                        progress=progress)
        if not (src / "config.json").exists():
            raise CheckpointError(f"{src}: no config.json; expected an HF model folder "
                                  "(config.json + *.safetensors) or a .gguf file")
        # The tokenizer files are copied into OUT; a folder whose tokenizer asks to run code
        # would be refused at every load, so it is refused here, before any work.
        check_folder(src)
        hf_config = read_json(src / "config.json")
        try:
            cfg = ModelConfig.from_hf(hf_config)
        except UnsupportedModelError:
            raise
        except ValueError as e:
            raise CheckpointError(f"{src / 'config.json'}: {e}") from e
        state = load_hf_state(src, progress=progress)

        def write_tokenizer(tmp: Path) -> None:
            _copy_tokenizer(src, tmp)
    elif src.suffix == ".gguf":
        from specjax.convert.gguf import read_gguf, save_gguf_tokenizer

        hf_config, state = read_gguf(src, progress=progress)
        try:
            cfg = ModelConfig.from_hf(hf_config)
        except UnsupportedModelError:
            raise
        except ValueError as e:
            raise CheckpointError(f"{src}: its metadata gives an invalid config ({e})") from e

        def write_tokenizer(tmp: Path) -> None:
            if tokenizer is not None:
                _copy_tokenizer(tokenizer, tmp)
            else:
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

    return write_atomically(out, build, overwrite=overwrite, sources=[src])
