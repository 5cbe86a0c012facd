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

import contextlib
import dataclasses
import json
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from filelock import FileLock, Timeout

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
        for f in dataclasses.fields(LayerParams):  # the stored layout, fused or not
            v = getattr(lp, f.name)
            if v is not None:
                flat[f"layers.{i}.{f.name}"] = v
    return flat


def unflatten_params(flat: dict[str, Any], num_layers: int) -> Params:
    """The :class:`Params` pytree from flat ``"layers.{i}.{field}"`` names (the inverse of
    the checkpoint's flattening); a field missing from ``flat`` is None (e.g. a tied
    ``lm_head``)."""
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


# Hidden names specjax gives its own temporary folders next to OUT: the folder being built,
# and the previous OUT while it is swapped out. Nothing else is ever deleted by name.
_PARTIAL = re.compile(r"\.(?P<name>.+)\.partial-[0-9a-f]{8}")
_OLD = re.compile(r"\.(?P<name>.+)\.old-[0-9a-f]{8}")


class OutputBusyError(CheckpointError):
    """Another process holds the lock of the output folder."""


class OutputNotWritableError(CheckpointError):
    """The output folder, or the lock file beside it, cannot be created."""


def is_specjax_folder(path: Path) -> bool:
    """Whether ``path`` is a folder specjax wrote: its manifest names a specjax format."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):  # absent, unreadable, not JSON or not UTF-8
        return False
    return isinstance(manifest, dict) and str(manifest.get("format", "")).startswith("specjax-")


def lock_path(out: Path) -> Path:
    """The lock file of output folder ``out``: ``.NAME.lock`` beside it, while it is held."""
    out = Path(out)
    return out.parent / f".{out.name}.lock"


_LOCKS: dict[str, FileLock] = {}


@contextlib.contextmanager
def output_lock(out: Path, *, wait: bool = False) -> Iterator[Path]:
    """Hold the lock of output folder ``out`` (resolved) for the body; yields the resolved path.

    One lock per output, ``.NAME.lock`` beside it while held (an OS file lock, so a killed
    holder releases it; the file is removed on release). It is re-entrant within a thread:
    the conversion holds it from its first check to its rename, and
    :func:`write_atomically` inside takes it again. With
    ``wait=False`` a held lock is refused at once (:class:`OutputBusyError`); with
    ``wait=True`` the caller waits, saying so on stderr once.
    """
    out = resolve_output(out)
    lock_file = lock_path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputNotWritableError(f"cannot create {out.parent} ({e.strerror or e}); choose "
                                     "an OUT in a folder you can write") from e
    lock = _LOCKS.setdefault(str(lock_file), FileLock(str(lock_file)))
    try:
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if not wait:
                raise OutputBusyError(
                    f"another specjax process is writing {out} (it holds {lock_file}); wait for "
                    "it to finish, or choose another OUT") from None
            print(f"waiting for another specjax process writing {out} ({lock_file})",
                  file=sys.stderr, flush=True)
            lock.acquire()
    except OSError as e:  # the lock file cannot be created: a read-only folder
        raise OutputNotWritableError(f"cannot create the lock file {lock_file} "
                                     f"({e.strerror or e}); choose an OUT in a folder you can "
                                     "write") from e
    try:
        yield out
    finally:
        if lock.lock_counter == 1:
            # Leave no file behind: unlink while still holding the lock. filelock checks
            # after every acquisition that the file it locked still has a name (st_nlink),
            # so a process that opened it just before the unlink retries on a fresh file
            # instead of sharing the lock.
            with contextlib.suppress(OSError):
                lock_file.unlink()
        lock.release()


def resolve_output(out: Path) -> Path:
    """The absolute path OUT names, symlinks resolved (a symlinked OUT is written through)."""
    out = Path(out)
    try:
        if out.is_symlink() and not out.exists():
            raise CheckpointError(f"{out} is a symlink to {os.readlink(out)}, which does not "
                                  "exist (or loops); remove the link or point it at a folder")
        return out.resolve()
    except (RuntimeError, OSError) as e:  # a symlink loop (RuntimeError before Python 3.13)
        raise CheckpointError(f"{out} cannot be resolved ({e}); is it a symlink loop?") from e


def clean_stale(out: Path) -> None:
    """Remove what an interrupted write to ``out`` left beside it; call with its lock held.

    A ``.NAME.partial-*`` folder is an unfinished build: removed. A ``.NAME.old-*`` folder
    is the previous OUT, moved aside just before the new one was renamed in: if OUT is
    missing (killed between the two renames) the newest complete one is put back, the rest
    are removed.
    """
    out = Path(out)
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return
    olds = sorted((e for e in entries if (m := _OLD.fullmatch(e.name)) and m["name"] == out.name
                   and e.is_dir() and not e.is_symlink()), key=lambda e: e.stat().st_mtime)
    if not out.exists() and olds and is_specjax_folder(olds[-1]):
        os.rename(olds.pop(), out)
    for e in entries:
        m = _PARTIAL.fullmatch(e.name)
        if m and m["name"] == out.name and e.is_dir() and not e.is_symlink():
            shutil.rmtree(e, ignore_errors=True)
    for e in olds:
        shutil.rmtree(e, ignore_errors=True)


def check_output(out: Path, *, overwrite: bool, sources: Sequence[Path] = ()) -> Path:
    """Refuse an OUT that writing there could lose data with; returns it resolved.

    Refused: OUT being, containing or lying inside one of ``sources`` (symlinks resolved);
    an existing OUT without ``overwrite``; OUT being a file; and, even with ``overwrite``, a
    non-empty folder that specjax did not write (no specjax manifest): specjax only ever
    replaces its own folders.
    """
    out = resolve_output(out)
    for src in sources:
        src = resolve_output(Path(src))
        if out == src or src in out.parents or out in src.parents:
            rel = ("is" if out == src else "lies inside" if src in out.parents else "contains")
            raise CheckpointError(f"OUT {out} {rel} the source {src}; writing it would destroy "
                                  "the source: choose an OUT outside the source")
    if not out.exists():
        return out
    if not out.is_dir():
        raise FileExistsError(f"{out} is a file, not a folder; specjax writes OUT as a folder "
                              "and never replaces a file: choose another OUT")
    if not overwrite:
        raise FileExistsError(f"{out} already exists; choose another OUT or pass --overwrite")
    if not is_specjax_folder(out):
        try:
            contents = sorted(p.name for p in out.iterdir())
        except OSError as e:
            raise CheckpointError(f"cannot list {out} ({e.strerror or e})") from e
        if contents:
            shown = ", ".join(contents[:3]) + (", ..." if len(contents) > 3 else "")
            raise FileExistsError(
                f"{out} is not a specjax folder (no {MANIFEST}) and is not empty ({shown}); "
                "--overwrite only replaces folders specjax wrote: choose another OUT, or empty "
                "or remove it yourself")
    return out


def write_atomically(out: Path, build: Callable[[Path], None], overwrite: bool = False,
                     sources: Sequence[Path] = ()) -> Path:
    """Run ``build(tmp_dir)`` and move the result to ``out`` only if it succeeds.

    Holds the output's lock (:func:`output_lock`) throughout. An existing ``out`` is
    refused unless ``overwrite``, and even then only a folder specjax wrote (or an empty
    one) is replaced, after the new folder is complete (:func:`check_output`). Leftovers
    of an interrupted earlier write are cleaned first (:func:`clean_stale`).
    """
    check_output(out, overwrite=overwrite, sources=sources)  # a refusal leaves no lock file
    with output_lock(out) as out:
        clean_stale(out)
        check_output(out, overwrite=overwrite, sources=sources)
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


def param_files(dir_: Path) -> dict[str, int]:
    """Byte size of every file orbax wrote under ``dir_/params``, keyed by relative path."""
    root = Path(dir_) / "params"
    return {p.relative_to(root).as_posix(): p.stat().st_size
            for p in sorted(root.rglob("*")) if p.is_file()}


def check_param_files(dir_: Path, files: Any) -> None:
    """Refuse a checkpoint whose tensor files differ in size from those its manifest lists.

    This catches truncation and missing files before orbax reads anything: a failed
    orbax read is reported from several tensorstore threads at once, and a byte count
    says more precisely what is wrong. Manifests written before the table existed have
    no ``files`` entry and are left to orbax.
    """
    if files is None:
        return
    if not isinstance(files, dict):
        raise CheckpointError(f"{dir_ / MANIFEST}: \"files\" must map paths to byte sizes; "
                              "convert the checkpoint again")
    root = Path(dir_) / "params"
    for rel, size in files.items():
        f = root / rel
        if not f.is_file():
            raise CheckpointError(f"{dir_}: tensor file params/{rel} is missing; the checkpoint "
                                  "is incomplete, convert it again")
        if f.stat().st_size != size:
            raise CheckpointError(f"{dir_}: tensor file params/{rel} has {f.stat().st_size} "
                                  f"bytes, the manifest says {size}; the checkpoint is corrupt "
                                  "(truncated or overwritten), convert it again")


def restore_params(dir_: Path, manifest: dict[str, Any],
                   mesh: Any = None) -> dict[str, jax.Array]:
    """Restore a flat dict written by :func:`save_params` given its manifest.

    Uses the manifest's ``tensors`` table ({name: [shape, dtype]}) for the abstract
    tree and its ``files`` table (when present) for a size check first. With a ``mesh``
    (:mod:`specjax.sharding`) each tensor is restored straight into its sharding: every
    device gets only its own slice and no host assembles the whole model (a tensor that
    conversion stored as one chunk is still decoded whole while it is read).
    """
    check_param_files(dir_, manifest.get("files"))
    shapes = manifest["tensors"]
    try:
        abstract = {k: jax.ShapeDtypeStruct(tuple(int(n) for n in s), jnp.dtype(d))
                    for k, (s, d) in shapes.items()}
        if mesh is not None:
            from specjax.sharding import flat_shardings

            placed = flat_shardings(abstract, mesh)
            abstract = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed[k])
                        for k, a in abstract.items()}
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{dir_ / MANIFEST}: \"tensors\" must map names to [shape, dtype] "
                              f"({type(e).__name__}: {e}); convert the checkpoint again") from e
    # Installed before the read: the other reads' callbacks may fail before the except
    # clause below runs.
    _quiet_closed_loop_callbacks()
    try:
        flat = ocp.StandardCheckpointer().restore(Path(dir_).absolute() / "params", abstract)
    except Exception as e:  # orbax raises many types; all mean the same thing here.
        raise CheckpointError(f"{dir_}: cannot restore tensors ({type(e).__name__}: {e}); the "
                              "checkpoint is corrupt, convert it again") from e
    if mesh is not None:
        return flat  # already jax arrays in their shardings
    # orbax hands back host numpy arrays; put them on the device once here, not
    # on every jitted call that takes them.
    return jax.device_put(flat)


def _quiet_closed_loop_callbacks() -> None:
    """Drop the "Event loop is closed" noise that a failed orbax restore leaves behind.

    When one read fails, orbax closes its asyncio loop while tensorstore still completes the
    other reads; their callbacks then raise ``RuntimeError('Event loop is closed')`` on
    tensorstore's threads, which tensorstore reports through ``sys.unraisablehook`` or
    ``PyErr_Print`` (``sys.excepthook``), around the clear error. Only that exact error is
    dropped; everything else reaches the old hooks. Idempotent.
    """
    def closed_loop(exc: BaseException | None) -> bool:
        return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"

    unraisable_before = sys.unraisablehook
    if not getattr(unraisable_before, "_specjax_quiet", False):
        def unraisable_hook(unraisable: Any) -> None:
            if not closed_loop(unraisable.exc_value):
                unraisable_before(unraisable)

        unraisable_hook._specjax_quiet = True  # type: ignore[attr-defined]
        sys.unraisablehook = unraisable_hook

    except_before = sys.excepthook
    if not getattr(except_before, "_specjax_quiet", False):
        def except_hook(kind: type, value: BaseException, tb: Any) -> None:
            if not closed_loop(value):
                except_before(kind, value, tb)

        except_hook._specjax_quiet = True  # type: ignore[attr-defined]
        sys.excepthook = except_hook


def save_tree(dir_: Path, flat: dict[str, Any], fmt: str, config: dict[str, Any],
              **extra: Any) -> None:
    """Write a flat dict of arrays and then its manifest (last) into an existing folder."""
    flat = {k: np.asarray(v) for k, v in flat.items()}
    save_params(dir_, flat)
    manifest = {"format": fmt, "version": VERSION, "config": config, **extra,
                "tensors": {k: [list(v.shape), str(v.dtype)] for k, v in flat.items()},
                "files": param_files(dir_)}
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


def read_manifest(dir_: Path, fmt: str | None = FORMAT) -> dict[str, Any]:
    """The manifest of a specjax folder, checked to be of format ``fmt`` (None: any
    specjax format, for callers that dispatch on it) and of this version."""
    dir_ = Path(dir_)
    if dir_.is_file():
        raise CheckpointError(f"{dir_} is a file; pass the checkpoint folder (a .gguf or HF "
                              "checkpoint must first be converted: `specjax convert SRC OUT`)")
    if not dir_.is_dir():
        raise CheckpointError(f"{dir_}: no such checkpoint folder; create one with "
                              "`specjax convert SRC OUT`")
    path = dir_ / MANIFEST
    if not path.exists():
        raise CheckpointError(f"{dir_}: not a specjax checkpoint (no {MANIFEST}); it may be an "
                              "unconverted HF folder or an interrupted conversion: run "
                              "`specjax convert SRC OUT`")
    try:
        manifest = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is corrupt ({e}); convert the checkpoint again") from e
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path} is corrupt (a JSON {type(manifest).__name__}, not an "
                              "object); convert the checkpoint again")
    fmt_ok = (str(manifest.get("format", "")).startswith("specjax-") if fmt is None
              else manifest.get("format") == fmt)
    if not fmt_ok or manifest.get("version") != VERSION:
        found = f"{manifest.get('format')!r} v{manifest.get('version')}"
        raise CheckpointError(f"{dir_}: format {found}, expected {fmt or 'specjax-*'!r} "
                              f"v{VERSION}; "
                              "convert it again")
    return manifest


# Each tensor's shape as products of config fields: the fields a wrong shape points at.
# (An int in a product is a constant factor, as in the drafter's fc [2d, d].)
_LAYER_DIMS: dict[str, tuple[tuple[str | int, ...], ...]] = {
    "attn_norm": (("hidden_size",),),
    "wq": (("hidden_size",), ("num_heads", "head_dim")),
    "wk": (("hidden_size",), ("num_kv_heads", "head_dim")),
    "wv": (("hidden_size",), ("num_kv_heads", "head_dim")),
    "wo": (("num_heads", "head_dim"), ("hidden_size",)),
    "mlp_norm": (("hidden_size",),),
    "w_gate": (("hidden_size",), ("intermediate_size",)),
    "w_up": (("hidden_size",), ("intermediate_size",)),
    "w_down": (("intermediate_size",), ("hidden_size",)),
    "bq": (("num_heads", "head_dim"),),
    "bk": (("num_kv_heads", "head_dim"),),
    "bv": (("num_kv_heads", "head_dim"),),
    "q_norm": (("head_dim",),),
    "k_norm": (("head_dim",),),
    "post_attn_norm": (("hidden_size",),),
    "post_mlp_norm": (("hidden_size",),),
}
_VOCAB_DIMS = (("vocab_size",), ("hidden_size",))


def layer_dims(cfg: ModelConfig, *, input_norm: bool = True) -> dict[str, tuple]:
    """The tensors of one decoder layer of ``cfg`` and their shapes as field products."""
    names = ["wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
    names += ["attn_norm"] if input_norm else []
    names += ["bq", "bk", "bv"] if cfg.attention_bias else []
    names += ["q_norm", "k_norm"] if cfg.qk_norm else []
    names += ["post_attn_norm", "post_mlp_norm"] if cfg.sandwich_norms else []
    return {n: _LAYER_DIMS[n] for n in names}


def target_dims(cfg: ModelConfig) -> dict[str, tuple]:
    """Every tensor of a target with config ``cfg``, flat names as :func:`flatten_params`."""
    dims: dict[str, tuple] = {"embed": _VOCAB_DIMS, "final_norm": (("hidden_size",),)}
    if not cfg.tie_word_embeddings:
        dims["lm_head"] = _VOCAB_DIMS
    for i in range(cfg.num_layers):
        dims |= {f"layers.{i}.{k}": v for k, v in layer_dims(cfg).items()}
    return dims


def check_tensor_shapes(where: Path, cfg: ModelConfig, dims: dict[str, tuple],
                        tensors: dict[str, Any]) -> None:
    """Refuse a manifest whose config disagrees with its tensors, naming the config field.

    ``dims`` maps each expected tensor to its shape as products of ``cfg`` fields (see
    :func:`target_dims`); ``tensors`` is the manifest's ``{name: [shape, dtype]}``.
    Checked at load so that a hand-edited config fails here, not as a shape error in a
    compiled matmul.
    """
    fix = "the manifest's config disagrees with its tensors: convert the checkpoint again"
    if not isinstance(tensors, dict):
        raise CheckpointError(f"{where}: \"tensors\" must be an object; {fix}")
    have_layers = {int(m[1]) for n in tensors if (m := re.match(r"layers\.(\d+)\.", n))}
    want_layers = {int(m[1]) for n in dims if (m := re.match(r"layers\.(\d+)\.", n))}
    if have_layers != want_layers and hasattr(cfg, "num_layers"):
        raise CheckpointError(f"{where}: config num_layers={cfg.num_layers} but the tensors "
                              f"hold {len(have_layers)} layers; {fix}")
    flags = {"lm_head": "tie_word_embeddings", "bq": "attention_bias", "bk": "attention_bias",
             "bv": "attention_bias", "q_norm": "qk_norm", "k_norm": "qk_norm",
             "attn_norm": "input_norm", "fc_bias": "fc_bias",
             "post_attn_norm": "sandwich_norms", "post_mlp_norm": "sandwich_norms"}
    for names, verb in ((sorted(set(dims) - set(tensors)), "lacks"),
                        (sorted(set(tensors) - set(dims)), "has unexpected")):
        if names:
            fields = sorted({flags.get(n.rsplit(".", 1)[-1], "") for n in names} - {""})
            fields = [f for f in fields if hasattr(cfg, f)]
            hint = (f" (config {', '.join(f'{f}={getattr(cfg, f, None)}' for f in fields)})"
                    if fields else "")
            raise CheckpointError(f"{where}: the checkpoint {verb} tensors {names[:4]}{hint}; "
                                  f"{fix}")
    for name, terms in dims.items():
        shape = tensors[name][0] if isinstance(tensors[name], list | tuple) and tensors[name] \
            else None
        want = [int(np.prod([f if isinstance(f, int) else getattr(cfg, f) for f in term]))
                for term in terms]
        if shape != want:
            fields = sorted({f for term in terms for f in term if isinstance(f, str)})
            got = ", ".join(f"{f}={getattr(cfg, f)}" for f in fields)
            raise CheckpointError(f"{where}: tensor {name} has shape {shape} but config {got} "
                                  f"gives {want}; {fix}")


def load_target(dir_: Path, dtype: str | None = None,
                mesh: Any = None) -> tuple[ModelConfig, Params]:
    """Config and device params of a converted target; ``dtype`` casts (e.g. "bfloat16").

    ``mesh``: restore every tensor directly into its sharding on that mesh (see
    :func:`restore_params`).

    Raises CheckpointError for a missing, foreign or corrupt folder, naming the manifest
    field when its config is invalid or disagrees with the stored tensor shapes.
    """
    manifest = read_manifest(dir_)
    where = Path(dir_) / MANIFEST
    try:
        cfg = ModelConfig.from_json(manifest.get("config"))
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}; convert the checkpoint again") from e
    check_tensor_shapes(where, cfg, target_dims(cfg), manifest.get("tensors"))
    flat = restore_params(dir_, manifest, mesh)
    if dtype is not None:
        flat = {k: v.astype(jnp.dtype(dtype)) for k, v in flat.items()}
    return cfg, unflatten_params(flat, cfg.num_layers)
