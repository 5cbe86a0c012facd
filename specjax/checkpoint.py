"""The specjax checkpoint folder: orbax tensors, a manifest, tokenizer files.

Layout of a converted target::

    OUT/
      specjax.json     manifest: format, config, dtype, tensor shapes, source
      params/          orbax-checkpoint of a flat {name: array} dict
      tokenizer.json, tokenizer_config.json, ...

The manifest is written last, and the folder is built under a temporary name
and renamed into place, so a folder that has ``specjax.json`` is complete.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from specjax.config import ModelConfig
from specjax.model import LayerParams, Params

MANIFEST = "specjax.json"
FORMAT = "specjax-target"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not match what was asked for."""


def flatten_params(params: Params) -> dict[str, Any]:
    """{"embed": ..., "layers.3.wq": ..., ...}; absent optional tensors are skipped."""
    flat = {"embed": params.embed, "final_norm": params.final_norm}
    if params.lm_head is not None:
        flat["lm_head"] = params.lm_head
    for i, lp in enumerate(params.layers):
        for f in dataclasses.fields(lp):
            v = getattr(lp, f.name)
            if v is not None:
                flat[f"layers.{i}.{f.name}"] = v
    return flat


def unflatten_params(flat: dict[str, Any], num_layers: int) -> Params:
    layers = []
    for i in range(num_layers):
        fields = {f.name: flat.get(f"layers.{i}.{f.name}") for f in dataclasses.fields(LayerParams)}
        layers.append(LayerParams(**fields))
    return Params(embed=flat["embed"], layers=tuple(layers), final_norm=flat["final_norm"],
                  lm_head=flat.get("lm_head"))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same folder and rename: never a half-written file."""
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Indented JSON, written atomically (:func:`atomic_write_bytes`)."""
    atomic_write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode())


def write_atomically(out: Path, build: Callable[[Path], None], overwrite: bool = False) -> Path:
    """Run ``build(tmp_dir)`` and move the result to ``out`` only if it succeeds.

    An existing ``out`` is refused unless ``overwrite``; even then it is only
    replaced after the new folder is complete.
    """
    out = Path(out).absolute()
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; choose another OUT or pass --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        build(tmp)
        if out.exists():
            trash = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out, trash)
            os.rename(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def save_params(dir_: Path, flat: dict[str, Any]) -> None:
    """Write a flat dict of arrays with orbax (blocking)."""
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(Path(dir_).absolute() / "params", {k: np.asarray(v) for k, v in flat.items()})
    ckptr.wait_until_finished()


def restore_params(dir_: Path, shapes: dict[str, tuple[list[int], str]]) -> dict[str, jax.Array]:
    """Restore a flat dict written by :func:`save_params` given its manifest shapes."""
    abstract = {k: jax.ShapeDtypeStruct(tuple(s), jnp.dtype(d)) for k, (s, d) in shapes.items()}
    try:
        flat = ocp.StandardCheckpointer().restore(Path(dir_).absolute() / "params", abstract)
    except Exception as e:  # orbax raises many types; all mean the same thing here.
        raise CheckpointError(f"{dir_}: cannot restore tensors ({type(e).__name__}: {e}); the "
                              "checkpoint is corrupt, convert it again") from e
    # orbax hands back host numpy arrays; put them on the device once here, not
    # on every jitted call that takes them.
    return jax.device_put(flat)


def save_tree(dir_: Path, flat: dict[str, Any], fmt: str, config: dict[str, Any],
              **extra: Any) -> None:
    """Write a flat dict of arrays and then its manifest (last) into an existing folder."""
    flat = {k: np.asarray(v) for k, v in flat.items()}
    save_params(dir_, flat)
    manifest = {"format": fmt, "version": VERSION, "config": config, **extra,
                "tensors": {k: [list(v.shape), str(v.dtype)] for k, v in flat.items()}}
    (Path(dir_) / MANIFEST).write_text(json.dumps(manifest, indent=1))


def write_checkpoint(out: Path, flat: dict[str, Any], fmt: str, config: dict[str, Any], *,
                     meta: dict | None = None, overwrite: bool = False) -> Path:
    """A whole checkpoint folder (tensors + manifest), written atomically."""
    return write_atomically(Path(out), lambda tmp: save_tree(tmp, flat, fmt, config,
                                                             meta=meta or {}),
                            overwrite=overwrite)


def save_target(dir_: Path, cfg: ModelConfig, params: Params, source: str) -> None:
    """Write a target's params and manifest into an existing folder."""
    save_tree(dir_, flatten_params(params), FORMAT, cfg.to_json(), source=source)


def read_manifest(dir_: Path, fmt: str = FORMAT) -> dict[str, Any]:
    dir_ = Path(dir_)
    if not dir_.is_dir():
        raise CheckpointError(f"{dir_}: no such checkpoint folder; create one with "
                              "`specjax convert SRC OUT`")
    path = dir_ / MANIFEST
    if not path.exists():
        raise CheckpointError(f"{dir_}: not a specjax checkpoint (no {MANIFEST}); it may be an "
                              "unconverted HF folder or an interrupted conversion: run "
                              "`specjax convert SRC OUT`")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is corrupt ({e}); convert the checkpoint again") from e
    if manifest.get("format") != fmt or manifest.get("version") != VERSION:
        found = f"{manifest.get('format')!r} v{manifest.get('version')}"
        raise CheckpointError(f"{dir_}: format {found}, expected {fmt!r} v{VERSION}; "
                              "convert it again")
    return manifest


def load_target(dir_: Path, dtype: str | None = None) -> tuple[ModelConfig, Params]:
    """Config and device params of a converted target; ``dtype`` casts (e.g. "bfloat16")."""
    manifest = read_manifest(dir_)
    cfg = ModelConfig.from_json(manifest["config"])
    flat = restore_params(dir_, manifest["tensors"])
    if dtype is not None:
        flat = {k: v.astype(jnp.dtype(dtype)) for k, v in flat.items()}
    return cfg, unflatten_params(flat, cfg.num_layers)
