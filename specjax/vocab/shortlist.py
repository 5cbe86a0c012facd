"""FR-Spec shortlists: rank token counts, store the lists, exchange them with other tools.

This module ranks the token counts of :mod:`specjax.vocab.corpus_counts` into drafter vocabularies::

    counts [V] int64 (count_tokens, or load_counts of freq_counts.npy)
      -> build_shortlist         Shortlist: N ids, most frequent first, EOS and chat specials kept
      -> save_shortlist/load_shortlist   fr_N.npy + fr_N.json (checked against the model)

and converts the lists other tools ship: FR-Spec's ``freq_{N}.pt`` and SGLang's
``--speculative-token-map`` files (:func:`import_token_list`, read *without* torch by
:func:`read_torch_file`) and plain ``.npy``/``.json`` id lists (:func:`export_token_list`).
:func:`sidecar_format` tells a counts file, a shortlist and a bare id list apart.

A shortlist is a ``.npy`` array and a ``.json`` sidecar holding the array's sha256, the
vocabulary size and the tokenizer fingerprint
(:func:`~specjax.vocab.corpus_counts.tokenizer_fingerprint`; see :mod:`specjax.vocab._files`), so
a list built for another tokenizer, a truncated copy or a mismatched pair is refused when
loaded rather than silently drafting the wrong tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import math
import pickle
import zipfile
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from specjax.checkpoint import atomic_write_bytes, write_json_atomic
from specjax.vocab._files import (
    REBUILD,
    SHORTLIST_FORMAT,
    VERSION,
    check_model,
    npy_bytes,
    pair,
    read_sidecar,
    sha256,
)

# --------------------------------------------------------------------------- shortlists


def _check_ids(ids: np.ndarray, vocab_size: int, where: str, fix: str = REBUILD) -> np.ndarray:
    """``ids`` as an int32 array after refusing shapes, types, out-of-range and repeats;
    ``fix`` ends the message of a list with ids out of range or repeated."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"{where}: expected a non-empty 1-D list of token ids, got shape "
                         f"{ids.shape}")
    if ids.dtype.kind not in "iu":
        raise ValueError(f"{where}: token ids must be integers, got {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(f"{where}: token ids outside the vocabulary [0, {vocab_size}): "
                         f"{bad[:5].tolist()}; the list was made for a larger vocabulary "
                         f"(another model?); {fix}")
    uniq, n = np.unique(ids, return_counts=True)
    if (n > 1).any():
        raise ValueError(f"{where}: duplicate token ids {uniq[n > 1][:5].tolist()}; a "
                         f"shortlist names each token once; {fix}")
    return ids.astype(np.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class Shortlist:
    """A frequency-ranked drafter vocabulary.

    ids: [N] int32 unique token ids, most frequent first, EOS and chat specials included.
    vocab_size: V of the model whose ids these are.
    tokenizer_fingerprint: :func:`~specjax.vocab.corpus_counts.tokenizer_fingerprint` of the
      tokenizer the ranking was counted with; None for an imported list that does not say.
    source: where the ranking comes from (corpus description or imported file).
    """

    ids: np.ndarray
    vocab_size: int
    tokenizer_fingerprint: str | None
    source: str

    def __post_init__(self):
        ids = _check_ids(self.ids, self.vocab_size, "shortlist")
        ids.flags.writeable = False
        object.__setattr__(self, "ids", ids)

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def __len__(self) -> int:
        return self.size


def _rank(counts: np.ndarray) -> np.ndarray:
    """All ids by decreasing count; a stable sort keeps equal counts in increasing id order."""
    return np.argsort(-np.asarray(counts, np.int64), kind="stable")


def _swap_in(ranked: np.ndarray, size: int, required: Sequence[int]) -> np.ndarray:
    """The first ``size`` of ``ranked``, with missing ``required`` ids replacing its tail.

    The kept ids stay in ``ranked`` order; required ids that ``ranked`` lacks go last.
    """
    req = np.unique(np.asarray(list(required), np.int64))
    keep = ranked[~np.isin(ranked, req)][: size - req.size]
    chosen = np.concatenate([keep, req])
    pos = np.full(int(max(ranked.max(initial=0), req.max(initial=0))) + 1, len(ranked))
    pos[ranked] = np.arange(len(ranked))
    return chosen[np.argsort(pos[chosen], kind="stable")]


def build_shortlist(counts: np.ndarray, size: int, required: Sequence[int] = (), *,
                    tokenizer_fingerprint: str | None = None, source: str = "") -> Shortlist:
    """The ``size`` most frequent ids of ``counts`` [V], ``required`` always included.

    Equal counts are ranked by lower id. A required id outside the top ``size`` takes the
    place of the least frequent non-required entry, so the list keeps exactly ``size``
    ids, still ordered by decreasing count.
    """
    counts = np.asarray(counts)
    v = counts.shape[0]
    req = sorted({int(r) for r in required})
    if any(not 0 <= r < v for r in req):
        raise ValueError(f"required token ids {req} fall outside the vocabulary [0, {v})")
    if not len(req) <= size <= v:
        raise ValueError(f"shortlist size {size} must lie in [{max(len(req), 1)}, {v}]: at "
                         f"least the {len(req)} required tokens (EOS, chat specials) and at "
                         f"most the vocabulary")
    if size < 1:
        raise ValueError(f"shortlist size must be >= 1, got {size}")
    return Shortlist(_swap_in(_rank(counts), size, req), v, tokenizer_fingerprint, source)


def with_required(sl: Shortlist, required: Sequence[int]) -> Shortlist:
    """``sl`` with missing ``required`` ids in place of its last (least frequent) entries.

    For imported rankings, which may omit EOS or the chat specials; the size is kept.
    """
    if len(set(required)) > sl.size:
        raise ValueError(f"a {sl.size}-token list cannot hold {len(set(required))} required ids")
    return dataclasses.replace(sl, ids=_swap_in(sl.ids.astype(np.int64), sl.size, required))


def save_shortlist(path: str | Path, sl: Shortlist, extra: dict | None = None) -> Path:
    """Write ``NAME.npy`` (int32 ids) and then ``NAME.json`` (metadata); returns the .npy."""
    npy, side = pair(path)
    npy.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(npy, npy_bytes(sl.ids))
    write_json_atomic(side, (extra or {}) | {
        "format": SHORTLIST_FORMAT, "version": VERSION, "size": sl.size,
        "vocab_size": sl.vocab_size, "tokenizer_fingerprint": sl.tokenizer_fingerprint,
        "source": sl.source, "sha256": sha256(sl.ids)})
    return npy


def load_shortlist(path: str | Path, *, vocab_size: int, fingerprint: str | None = None,
                   eos_ids: Iterable[int] = ()) -> Shortlist:
    """Read a :func:`save_shortlist` pair and check it fits the model it will serve.

    Refuses: another vocabulary size, another tokenizer (when both fingerprints are
    known), ids out of range or repeated, an array that does not match its sidecar, and a
    list that omits one of ``eos_ids`` (a draft could never end).
    """
    npy, side = pair(path)
    meta = read_sidecar(npy, side, SHORTLIST_FORMAT, "shortlist")
    check_model(npy, meta, vocab_size, fingerprint, "shortlist")
    ids = np.load(npy, allow_pickle=False)
    sl = Shortlist(_check_ids(ids, vocab_size, str(npy)), vocab_size,
                   meta.get("tokenizer_fingerprint"), meta.get("source", ""))
    if sha256(sl.ids) != meta.get("sha256") or sl.size != meta.get("size"):
        raise ValueError(f"{npy} does not match its sidecar {side.name} (edited or from "
                         f"another run); {REBUILD}")
    missing = sorted(set(int(e) for e in eos_ids) - set(sl.ids.tolist()))
    if missing:
        raise ValueError(f"{npy}: the shortlist omits EOS id {missing[0]}"
                         f"{'' if len(missing) == 1 else f' (and {missing[1:]})'}, so no draft "
                         f"could end; {REBUILD} (it always keeps EOS and the chat template's "
                         "special tokens)")
    return sl


# --------------------------------------------------------------------------- import / export

# torch storage classes -> numpy dtypes (little-endian; the archive's byteorder may flip it).
# BFloat16 has no numpy dtype; it is read as raw uint16 only to refuse it as non-integer.
_TORCH_STORAGES = {
    "LongStorage": "i8", "IntStorage": "i4", "ShortStorage": "i2", "CharStorage": "i1",
    "ByteStorage": "u1", "BoolStorage": "?", "DoubleStorage": "f8", "FloatStorage": "f4",
    "HalfStorage": "f2", "BFloat16Storage": "V2",
}


@dataclasses.dataclass(frozen=True)
class _StorageType:
    name: str
    dtype: str


def _rebuild_tensor(storage: np.ndarray, offset: int, size: Sequence[int],
                    stride: Sequence[int], *_: Any) -> np.ndarray:
    """numpy stand-in for ``torch._utils._rebuild_tensor(_v2)``: a strided view, copied."""
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    if 0 in size:
        return np.zeros(size, storage.dtype)
    last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if offset < 0 or last >= storage.size or min(stride, default=0) < 0:
        raise ValueError("torch file: a tensor lies outside its storage (corrupt file)")
    if min(size, default=0) < 0 or math.prod(size) > storage.size:
        # A zero stride could make a few stored bytes a huge tensor; a list of ids never
        # repeats its storage, so refuse before copying terabytes.
        raise ValueError(f"torch file: a tensor of shape {size} does not fit its storage of "
                         f"{storage.size} elements (corrupt or crafted file)")
    view = np.lib.stride_tricks.as_strided(storage[offset:], size,
                                           tuple(s * storage.itemsize for s in stride))
    return np.array(view)


class _TorchUnpickler(pickle.Unpickler):
    """Reads ``torch.save`` pickles with numpy arrays for tensors; torch is never imported.

    Only the classes a list of ids or a plain tensor needs are resolved; anything else
    is refused, which also makes loading an untrusted file safe (no arbitrary code).
    """

    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str, byteorder: str):
        super().__init__(io.BytesIO(data))
        self._archive, self._prefix = archive, prefix
        self._order = ">" if byteorder == "big" else "<"
        self._storages: dict[str, np.ndarray] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in ("_rebuild_tensor", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if module == "torch" and name in _TORCH_STORAGES:
            return _StorageType(name, _TORCH_STORAGES[name])
        if module == "collections" and name == "OrderedDict":  # a tensor's backward hooks
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"unsupported object {module}.{name}; expected a list of "
                                     "token ids or an integer tensor")

    def persistent_load(self, pid: Any) -> np.ndarray:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise pickle.UnpicklingError(f"unsupported storage reference {pid!r}")
        _, stype, key, _location, numel = pid
        if key not in self._storages:
            raw = self._archive.read(f"{self._prefix}data/{key}")
            dtype = np.dtype(stype.dtype).newbyteorder(self._order)
            self._storages[key] = np.frombuffer(raw, dtype, count=int(numel))
        return self._storages[key]


def read_torch_file(path: str | Path) -> Any:
    """The object in a (zip-format, torch >= 1.6) ``torch.save`` file; tensors as numpy."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not a zip-format torch file (legacy torch < 1.6 format, or "
                         "not a torch file); re-save it with a recent torch, or export the ids "
                         "as .npy or .json")
    try:
        with zipfile.ZipFile(path) as z:
            pkl = [n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            if len(pkl) != 1:
                raise ValueError(f"{path}: a torch archive holds exactly one data.pkl, found "
                                 f"{len(pkl)}")
            prefix = pkl[0][: -len("data.pkl")]
            names = set(z.namelist())
            order = (z.read(prefix + "byteorder").decode().strip()
                     if prefix + "byteorder" in names else "little")
            try:
                return _TorchUnpickler(z.read(pkl[0]), z, prefix, order).load()
            except (pickle.UnpicklingError, KeyError, EOFError) as e:
                raise ValueError(f"{path}: cannot read it as a token list ({e})") from e
            except Exception as e:  # noqa: BLE001
                # A crafted or damaged pickle can call an allowed function with wrong arguments
                # (TypeError), or with sizes that do not fit (ValueError, OverflowError, ...).
                # Only the allowed functions ever run, so any failure means a bad file.
                raise ValueError(f"{path}: not a valid torch token list "
                                 f"({type(e).__name__}: {e}); re-save it with "
                                 "torch.save(list_of_ids) or export the ids as .npy or .json"
                                 ) from e
    except (zipfile.BadZipFile, zlib.error, NotImplementedError, UnicodeDecodeError) as e:
        # The archive itself is damaged (a CRC or compression error, a bad byteorder).
        raise ValueError(f"{path}: damaged torch archive ({type(e).__name__}: {e}); "
                         "re-save or re-download it") from e


def _as_id_array(obj: Any, where: Path) -> np.ndarray:
    if isinstance(obj, dict) and obj.get("format") == SHORTLIST_FORMAT:
        raise ValueError(f"{where} is a specjax shortlist sidecar; load the pair with "
                         "load_shortlist")
    if isinstance(obj, list | tuple):
        # A list of Python ints (FR-Spec) or of 0-d tensors (``list(tensor)``).
        def is_id(x: Any) -> bool:
            if isinstance(x, np.ndarray):
                return x.ndim == 0 and x.dtype.kind in "iu"
            return isinstance(x, int | np.integer) and not isinstance(x, bool)

        if not all(is_id(x) for x in obj):
            raise ValueError(f"{where}: expected a list of integer token ids")
        obj = np.asarray([int(x) for x in obj], np.int64)
    if not isinstance(obj, np.ndarray):
        raise ValueError(f"{where}: expected a list of token ids or a 1-D integer tensor, got "
                         f"{type(obj).__name__}")
    if obj.dtype.kind not in "iu":
        raise ValueError(f"{where}: token ids must be integers, got a {obj.dtype} tensor")
    return obj.astype(np.int64)


def sidecar_format(path: str | Path) -> str | None:
    """The ``format`` of a ``.npy`` file's JSON sidecar (counts or shortlist), else None.

    None means a bare list of ids (``.pt``, ``.npy`` or ``.json`` without our sidecar),
    which :func:`import_token_list` reads.
    """
    npy, side = pair(path)
    if Path(path).suffix not in ("", ".npy", ".json") or not (npy.exists() and side.exists()):
        return None
    try:
        meta = json.loads(side.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return meta.get("format") if isinstance(meta, dict) else None


def import_token_list(path: str | Path, *, vocab_size: int) -> Shortlist:
    """A token list from another tool, in its order, as a :class:`Shortlist`.

    Reads FR-Spec's ``freq_{N}.pt`` (``torch.save`` of a list of ids, most frequent
    first) and SGLang ``--speculative-token-map`` files (``torch.save`` of an int64
    tensor or list of hot ids), without importing torch, plus ``.npy`` arrays and
    ``.json`` lists. Such files carry no tokenizer fingerprint (None here), so only the
    vocabulary range is checked; they may also omit EOS, see :func:`with_required`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such token-list file")
    suffix = path.suffix.lower()
    if suffix in (".pt", ".pth"):
        obj = read_torch_file(path)
    elif suffix == ".npy":
        try:
            obj = np.load(path, allow_pickle=False)
        except ValueError as e:
            raise ValueError(f"{path}: not a plain numpy array of ids ({e})") from e
    elif suffix == ".json":
        try:
            obj = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e}); expected a list of token ids") from e
    else:
        raise ValueError(f"{path}: unsupported token-list suffix {path.suffix!r}; use .pt/.pth "
                         "(FR-Spec, SGLang), .npy or .json")
    # Another tool's file: it is the file to fix, not a shortlist specjax wrote to rebuild.
    ids = _check_ids(_as_id_array(obj, path), vocab_size, str(path),
                     fix="fix the file, or build a shortlist with `specjax build-shortlist`")
    return Shortlist(ids, vocab_size, None, f"imported from {path.name}")


def export_token_list(sl: Shortlist, path: str | Path) -> Path:
    """Write the ids alone, in order: ``.npy`` (int64) or ``.json`` (a plain list).

    These are the interchange forms other tools read; SGLang's token map is a torch file,
    made from the .json with ``torch.save(torch.tensor(json.load(f)), "map.pt")``.
    """
    path = Path(path)
    if path.suffix == ".npy":
        data = npy_bytes(sl.ids.astype(np.int64))
    elif path.suffix == ".json":
        data = json.dumps(sl.ids.tolist()).encode()
    else:
        raise ValueError(f"{path}: export to .npy or .json (writing .pt would need torch)")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, data)
    return path
