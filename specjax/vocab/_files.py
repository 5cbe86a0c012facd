"""Files shared by token counts and shortlists: ``NAME.npy`` + ``NAME.json`` sidecar pairs.

A pair is written array first, then sidecar, each atomically (temporary file + rename); the
sidecar records the format, version, vocabulary size, tokenizer fingerprint and the array's
sha256. :func:`read_sidecar` and :func:`check_model` refuse a pair that lacks a half, has
another format or version, or was made for another vocabulary or tokenizer.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np

SHORTLIST_FORMAT = "specjax-shortlist"
COUNTS_FORMAT = "specjax-token-counts"
VERSION = 1

REBUILD = "rebuild it with `specjax build-shortlist`"


def sha256(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def pair(path: str | Path) -> tuple[Path, Path]:
    """(NAME.npy, NAME.json) for ``NAME``, ``NAME.npy`` or ``NAME.json``."""
    path = Path(path)
    base = path.with_suffix("") if path.suffix in (".npy", ".json") else path
    return base.with_name(base.name + ".npy"), base.with_name(base.name + ".json")


def short(fp: str | None) -> str:
    return "none" if fp is None else fp[:12]


def read_sidecar(npy: Path, side: Path, fmt: str, what: str, rebuild: str = REBUILD) -> dict:
    for p in (npy, side):
        if not p.exists():
            raise FileNotFoundError(f"{p} is missing: a {what} is the pair {npy.name} + "
                                    f"{side.name}; {rebuild}")
    try:
        meta = json.loads(side.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{side} is corrupt ({e}); {rebuild}") from e
    if not isinstance(meta, dict) or meta.get("format") != fmt or meta.get("version") != VERSION:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{side}: format {found!r}, expected {fmt!r} v{VERSION}"
                         + ("; for a bare list of ids use import_token_list (`specjax "
                            "build-shortlist --import`)" if fmt == SHORTLIST_FORMAT else ""))
    return meta


def check_model(where: Path, meta: dict, vocab_size: int | None, fingerprint: str | None,
                what: str, rebuild: str = REBUILD) -> None:
    if vocab_size is not None and meta["vocab_size"] != vocab_size:
        raise ValueError(f"{where}: this {what} is for a vocabulary of {meta['vocab_size']} ids "
                         f"but the model has {vocab_size} (another model?); {rebuild}")
    theirs = meta.get("tokenizer_fingerprint")
    if fingerprint is not None and theirs is not None and theirs != fingerprint:
        raise ValueError(f"{where}: this {what} was built with another tokenizer (fingerprint "
                         f"{short(theirs)}, the model's is {short(fingerprint)}), so its ids "
                         f"name other tokens; {rebuild} for this model")
