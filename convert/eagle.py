"""Import HF-form EAGLE drafters (SafeAILab/EAGLE) into specjax drafter folders.

Two source layouts, told apart by their tensor names:

* EAGLE-1/2 (``eagle/model/cnets1.py``): ``fc`` [d, 2d] (+ ``fc.bias``) over
  ``[embedding; feature]`` and one Llama/Qwen decoder layer ``layers.0.*``
  whose input RMSNorm is usually absent. Written with
  :func:`specjax.drafter.save_drafter`.
* EAGLE-3 (``eagle/model/cnets.py``): ``fc`` [d, 3*Dt], ``midlayer.*`` with a
  2d-wide attention input and ``hidden_norm``, a final ``norm``, an own
  ``lm_head`` [Vd, d] and the ``d2t`` / ``t2d`` vocabulary maps. Written with
  :func:`specjax.eagle3.save_eagle3`.

Weights are read from ``*.safetensors`` or, when only those are absent, from
``pytorch_model.bin`` (torch is imported lazily: it is a test-only
dependency). ``embed_tokens.weight`` is a copy of the target's embedding and
is dropped after a shape check (kept only by an EAGLE-3 drafter trained at
its own width). ``*.rotary_emb.inv_freq`` buffers, which old checkpoints
saved, are recomputed from config.json and ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from specjax.checkpoint import CheckpointError, check_output
from specjax.config import ModelConfig
from specjax.convert.hf import layer_from_hf, to_f32
from specjax.drafter import DrafterConfig, DrafterParams, save_drafter
from specjax.eagle3 import (
    Eagle3Config,
    check_vocab_map,
    hf_shapes,
    params_from_hf_state,
    save_eagle3,
)

EagleKind = Literal["eagle", "eagle3"]

_LAYER = re.compile(r"^(?:layers|midlayer)\.(\d+)\.")
# Tensors that carry no information specjax needs (RoPE tables are recomputed).
_IGNORED = re.compile(r"(^|\.)rotary_emb\.(inv_freq|cos_cached|sin_cached)$")
_REDUCED_FLOATS = ("BF16", "F8_E4M3", "F8_E5M2")


# --------------------------------------------------------------------------- reading


def _safetensors_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def _torch_files(path: Path) -> list[Path]:
    return sorted(path.glob("pytorch_model*.bin"))


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array): floats as fp32, integer / bool tensors (d2t, t2d) exactly as stored."""
    for file in files:
        try:
            with safe_open(file, framework="numpy") as f:
                names = list(f.keys())
                reduced = [n for n in names if f.get_slice(n).get_dtype() in _REDUCED_FLOATS]
                for name in names:
                    if name in reduced:
                        continue
                    a = f.get_tensor(name)
                    yield name, a.astype(np.float32) if a.dtype.kind == "f" else a
            if reduced:
                # numpy has no bfloat16; the flax framework reads it through ml_dtypes.
                with safe_open(file, framework="flax") as f:
                    for name in reduced:
                        yield name, to_f32(f, name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: cannot read safetensors ({e}); the file is truncated "
                                  "or corrupt, download it again") from e


def _import_torch(file: Path):
    try:
        import torch
    except ImportError as e:
        raise CheckpointError(
            f"{file}: reading pytorch_model.bin needs torch, which specjax does not install; "
            "`pip install torch`, or re-save the drafter as model.safetensors (e.g. "
            "`safetensors.torch.save_file(torch.load(bin), 'model.safetensors')`)") from e
    return torch


def _iter_torch_bin(files: list[Path]) -> Iterator[tuple[str, np.ndarray]]:
    for file in files:
        torch = _import_torch(file)
        try:
            sd = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # zip, pickle and storage errors all mean a bad file here.
            raise CheckpointError(f"{file}: cannot read the torch state dict "
                                  f"({type(e).__name__}: {e}); the file is truncated or corrupt, "
                                  "download it again") from e
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise CheckpointError(f"{file}: expected a state dict of tensors, got "
                                  f"{type(sd).__name__}")
        for name, t in sd.items():
            t = t.detach().cpu()
            yield name, (t.float() if t.is_floating_point() else t).numpy()


def read_drafter_state(path: Path, progress: bool = True) -> dict[str, np.ndarray]:
    """All tensors of a drafter folder (safetensors preferred over pytorch_model.bin)."""
    path = Path(path)
    if files := _safetensors_files(path):
        it = _iter_safetensors(files)
    elif files := _torch_files(path):
        it = _iter_torch_bin(files)
    else:
        raise CheckpointError(f"{path}: no model.safetensors or pytorch_model.bin; expected an "
                              "EAGLE drafter folder (config.json + weights)")
    return {name: a for name, a in tqdm(it, desc="read drafter", unit="tensor",
                                         disable=not progress) if not _IGNORED.search(name)}


def _read_config(path: Path) -> dict[str, Any]:
    file = Path(path) / "config.json"
    if not file.exists():
        raise CheckpointError(f"{path}: no config.json; expected an EAGLE drafter folder "
                              "(config.json + model.safetensors or pytorch_model.bin)")
    try:
        hf = json.loads(file.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON ({e})") from e
    if not isinstance(hf, dict):
        raise CheckpointError(f"{file} holds a JSON {type(hf).__name__}, not an object")
    if "auto_map" in hf:  # the same rule as every folder specjax reads: no custom code
        raise CheckpointError(f"{file} has an \"auto_map\" field, which asks to run Python "
                              "code shipped in the folder; specjax never runs code from a "
                              "checkpoint: remove the field or use a drafter without it")
    return hf


def _weight_names(path: Path) -> set[str] | None:
    """Tensor names without loading tensors; None when they cannot be listed."""
    try:
        if files := _safetensors_files(path):
            names: set[str] = set()
            for file in files:
                with safe_open(file, framework="numpy") as f:
                    names |= set(f.keys())
            return names
        if files := _torch_files(path):
            import torch  # only to list names; an absent torch falls back to config.json

            names = set()
            for file in files:
                names |= set(torch.load(file, map_location="cpu", weights_only=True,
                                        mmap=True).keys())
            return names
    except Exception:  # unreadable: let the converter report it properly
        return None
    return None


# --------------------------------------------------------------------------- detection


def eagle_kind(path: str | Path) -> EagleKind | None:
    """Which EAGLE drafter ``path`` holds: "eagle" (EAGLE-1/2), "eagle3", or None (not one).

    An EAGLE folder has ``fc.weight`` and no ``model.layers.*`` (which marks a
    full HF model); EAGLE-3 adds ``midlayer.*`` / ``hidden_norm`` / ``d2t``.
    """
    path = Path(path)
    if not path.is_dir() or not (path / "config.json").exists():
        return None
    try:
        hf = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, OSError):
        return None
    names = _weight_names(path)
    if names is None:
        # Only a pytorch_model.bin without torch (or an unreadable file): guess
        # from config.json so the EAGLE converter can explain what is missing.
        archs = " ".join(hf.get("architectures") or []).lower()
        if "draft_vocab_size" in hf or "eagle3" in archs:
            return "eagle3"
        if "eagle" in archs or (hf.get("num_hidden_layers") == 1 and _torch_files(path)):
            return "eagle"
        return None
    if "fc.weight" not in names or any(n.startswith("model.layers.") for n in names):
        return None
    if ("d2t" in names or "draft_vocab_size" in hf
            or any(n.startswith("midlayer.") or n.endswith("hidden_norm.weight") for n in names)):
        return "eagle3"
    return "eagle"


def is_eagle_folder(path: str | Path) -> bool:
    """True for an EAGLE-1/2 drafter folder (fc over [embedding; feature] + ``layers.0``)."""
    return eagle_kind(path) == "eagle"


def is_eagle3_folder(path: str | Path) -> bool:
    """True for an EAGLE-3 drafter folder (fc over 3 target layers + ``midlayer``)."""
    return eagle_kind(path) == "eagle3"


# --------------------------------------------------------------------------- shared checks


def _np_dtype(dtype: str):
    return np.dtype(dtype) if dtype != "bfloat16" else __import__("ml_dtypes").bfloat16


def _layer_config(hf: dict[str, Any], src: Path, *, llama_layer: bool = False) -> ModelConfig:
    """ModelConfig of the drafter's one decoder layer from its config.json.

    EAGLE configs name drafter classes (e.g. ``LlamaForCausalLMEagle3``) in
    ``architectures`` and may omit ``model_type``; neither describes the layer.
    """
    d = {k: v for k, v in hf.items() if k != "architectures"}
    d["model_type"] = "llama" if llama_layer else (d.get("model_type") or "llama")
    if llama_layer:  # cnets.py's midlayer has no q/k/v bias and no q/k norm
        d["attention_bias"] = False
    d["num_hidden_layers"] = 1
    try:
        return ModelConfig.from_hf(d)
    except KeyError as e:
        raise CheckpointError(f"{src}/config.json lacks {e.args[0]!r}") from e


def _check_names(want: dict[str, tuple[int, ...]], optional: dict[str, tuple[int, ...]],
                 state: dict[str, np.ndarray], source: str) -> None:
    """Refuse extra layers, missing, unexpected or mis-shaped tensors, naming each."""
    layers = sorted({int(m.group(1)) for n in state if (m := _LAYER.match(n))})
    if layers and layers != [0]:
        raise CheckpointError(f"{source}: the drafter has decoder layers {layers}; specjax "
                              "drafters have exactly one (EAGLE's single-layer design)")
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want) - set(optional))
    if missing:
        raise CheckpointError(f"{source}: {len(missing)} tensors missing, e.g. {missing[:5]}; is "
                              "the checkpoint complete and does config.json match it?")
    if extra:
        raise CheckpointError(f"{source}: {len(extra)} unexpected tensors, e.g. {extra[:5]}; the "
                              "checkpoint does not match config.json or is not this EAGLE kind")
    shapes = want | optional
    bad = [f"{k}: {tuple(state[k].shape)} != {shapes[k]}" for k in sorted(state)
           if tuple(state[k].shape) != shapes[k]]
    if bad:
        raise CheckpointError(f"{source}: shape mismatch against config.json: {bad[:5]}")


# --------------------------------------------------------------------------- EAGLE-1/2


def eagle_shapes(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]],
                                             dict[str, tuple[int, ...]]]:
    """(required, optional) HF-layout tensors of an EAGLE-1/2 drafter for layer config ``cfg``."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    p, a = "layers.0.", "layers.0.self_attn."
    want = {"fc.weight": (d, 2 * d), a + "q_proj.weight": (q, d), a + "k_proj.weight": (kv, d),
            a + "v_proj.weight": (kv, d), a + "o_proj.weight": (d, q),
            p + "post_attention_layernorm.weight": (d,), p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d), p + "mlp.down_proj.weight": (d, f)}
    if cfg.attention_bias:
        want |= {a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)}
    if cfg.qk_norm:
        want |= {a + "q_norm.weight": (cfg.head_dim,), a + "k_norm.weight": (cfg.head_dim,)}
    optional = {"fc.bias": (d,), p + "input_layernorm.weight": (d,),
                "embed_tokens.weight": (cfg.vocab_size, d)}
    return want, optional


def convert_eagle(src: str | Path, out: str | Path, *, target_cfg: ModelConfig | None = None,
                  overwrite: bool = False, dtype: str = "float32",
                  progress: bool = True) -> Path:
    """Convert an HF-form EAGLE-1/2 drafter folder into a specjax drafter folder.

    Args:
      src: config.json (LlamaConfig-like; ``bias`` says whether fc has one) and
        ``model.safetensors`` or ``pytorch_model.bin``.
      out: the folder to create; refused if it exists unless ``overwrite``.
      target_cfg: when given, refuse a drafter built for another target
        (:class:`specjax.drafter.DrafterMismatchError`).
      dtype: weight dtype to store ("float32" or "bfloat16").
    Returns:
      The absolute path of the folder, readable with :func:`specjax.drafter.read_drafter`.
    """
    src = Path(src)
    check_output(Path(out), overwrite=overwrite, sources=[src])  # before reading weights
    hf = _read_config(src)
    if eagle_kind(src) == "eagle3":
        raise CheckpointError(f"{src}: this is an EAGLE-3 drafter (midlayer / d2t); convert it "
                              "with convert_eagle3 or `specjax convert`")
    if (n := hf.get("num_hidden_layers", 1)) != 1:
        raise CheckpointError(f"{src}: config.json has num_hidden_layers={n}; specjax drafters "
                              "have exactly one decoder layer")
    cfg = _layer_config(hf, src)
    if target_cfg is not None:  # before reading weights: a wrong target fails fast
        DrafterConfig(cfg).check_target(target_cfg, "EAGLE drafter")
    state = read_drafter_state(src, progress=progress)
    want, optional = eagle_shapes(cfg)
    _check_names(want, optional, state, str(src))
    fc_bias = "fc.bias" in state
    if "bias" in hf and bool(hf["bias"]) != fc_bias:
        raise CheckpointError(f"{src}: config.json says bias={hf['bias']} but fc.bias is "
                              f"{'present' if fc_bias else 'absent'}")
    input_norm = "layers.0.input_layernorm.weight" in state
    dcfg = DrafterConfig(cfg, input_norm=input_norm, fc_bias=fc_bias)
    np_dtype = _np_dtype(dtype)

    def get(name: str, transpose: bool = False) -> np.ndarray | None:
        if name not in state:
            return None
        a = state[name]
        return np.ascontiguousarray(a.T if transpose else a).astype(np_dtype)

    layer = layer_from_hf(state, "layers.0.", np_dtype)
    # fc rows must be [embedding; feature]: torch's fc.weight is [d, 2d] over cat(emb, feat).
    params = DrafterParams(fc=get("fc.weight", True), layers=(layer,), fc_bias=get("fc.bias"))
    meta = {"source": str(src.absolute()), "source_format": "eagle", "eagle_config": hf}
    return save_drafter(Path(out), dcfg, params, meta=meta, overwrite=overwrite)


# --------------------------------------------------------------------------- EAGLE-3


def eagle3_config(hf: dict[str, Any], src: Path) -> Eagle3Config:
    """Eagle3Config from an EAGLE-3 config.json (``draft_vocab_size``, ``target_hidden_size``)."""
    layer = _layer_config(hf, src, llama_layer=True)
    dt = int(hf.get("target_hidden_size") or layer.hidden_size)
    return Eagle3Config(layer=layer,
                        draft_vocab_size=int(hf.get("draft_vocab_size") or layer.vocab_size),
                        target_hidden_size=dt, own_embed=dt != layer.hidden_size)


def convert_eagle3(src: str | Path, out: str | Path, *, target_cfg: ModelConfig | None = None,
                   overwrite: bool = False, dtype: str = "float32",
                   progress: bool = True) -> Path:
    """Convert an HF-form EAGLE-3 drafter folder into a specjax EAGLE-3 folder.

    ``midlayer.*`` may also be named ``layers.0.*`` (as vLLM / SGLang rename
    it). When the draft vocabulary is the full vocabulary, EAGLE ignores
    d2t / t2d, and so does this import: the map becomes the identity.
    Returns the absolute path, readable with :func:`specjax.eagle3.read_eagle3`.
    """
    src = Path(src)
    check_output(Path(out), overwrite=overwrite, sources=[src])  # before reading weights
    hf = _read_config(src)
    if eagle_kind(src) == "eagle":
        raise CheckpointError(f"{src}: this is an EAGLE-1/2 drafter (layers.0, fc over 2d); "
                              "convert it with convert_eagle or `specjax convert`")
    cfg = eagle3_config(hf, src)
    if target_cfg is not None:
        cfg.check_target(target_cfg)
    state = {re.sub(r"^layers\.0\.", "midlayer.", k): v
             for k, v in read_drafter_state(src, progress=progress).items()}
    vd, v = cfg.draft_vocab_size, cfg.layer.vocab_size
    if vd > v:
        raise CheckpointError(f"{src}: draft_vocab_size={vd} exceeds vocab_size={v}")
    want = hf_shapes(cfg)
    optional = {} if cfg.own_embed else {"embed_tokens.weight": (v, cfg.layer.hidden_size)}
    identity_map = vd == v
    if identity_map:  # EAGLE deletes d2t / t2d when the draft vocabulary is the whole vocabulary
        optional |= {"d2t": want.pop("d2t"), "t2d": want.pop("t2d")}
    _check_names(want, optional, state, str(src))
    if identity_map:
        state["d2t"] = np.zeros(v, np.int64)
        state["t2d"] = np.ones(v, bool)
    for name, kinds in (("d2t", "iu"), ("t2d", "biu")):
        a = state[name]
        if a.dtype.kind not in kinds and not (a.dtype.kind == "f" and np.all(a == np.round(a))):
            raise CheckpointError(f"{src}: {name} has dtype {a.dtype}; expected integers")
    try:
        check_vocab_map(state["d2t"], state["t2d"], v, source=str(src))
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    if not cfg.own_embed:
        state.pop("embed_tokens.weight", None)  # a copy of the target's; shape checked above
    params = params_from_hf_state(state, dtype=_np_dtype(dtype))
    meta = {"source": str(src.absolute()), "source_format": "eagle3", "eagle_config": hf,
            "vocab_map": "identity" if identity_map else "d2t"}
    return save_eagle3(Path(out), cfg, params, meta=meta, overwrite=overwrite)


def convert_eagle_folder(src: str | Path, out: str | Path, *,
                         target_cfg: ModelConfig | None = None, overwrite: bool = False,
                         dtype: str = "float32", progress: bool = True) -> Path:
    """Convert an EAGLE-1/2 or EAGLE-3 folder, whichever :func:`eagle_kind` finds."""
    kind = eagle_kind(src)
    if kind is None:
        raise CheckpointError(f"{src}: not an EAGLE drafter folder (no fc.weight, or it holds a "
                              "full model's model.layers.*)")
    fn = convert_eagle3 if kind == "eagle3" else convert_eagle
    return fn(src, out, target_cfg=target_cfg, overwrite=overwrite, dtype=dtype,
              progress=progress)
