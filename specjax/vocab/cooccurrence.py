"""EvoSpec's token co-occurrence graph: each token's likely successors, from bigram counts.

EvoSpec (appendix A.3) builds a graph offline from bigram statistics: an edge u -> v
when v follows u in the corpus, weighted by p(v | u), keeping edges seen at least
``min_count`` times with ``p(v | u) >= min_prob``, at most ``max_degree`` per source. At
an OOV event the dynamic vocabulary requests the first few successors of the recalled
tokens (collocations a semantic search misses).

Files: ``NAME.npy`` [V, max_degree] int32 successors by decreasing p(v | u), -1-padded,
and the ``NAME.json`` sidecar (format, vocabulary size, tokenizer fingerprint, sha256,
settings, corpus, tokens counted). A graph of another tokenizer is refused when loaded.

Counting is resumable: ``OUT.counting/`` holds the sparse counts so far (pair keys
``u * V + v`` and their counts) and the documents done; rerunning the same command
continues.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from specjax.checkpoint import atomic_write_bytes, write_json_atomic
from specjax.vocab._files import VERSION, check_model, npy_bytes, pair, read_sidecar, sha256

GRAPH_FORMAT = "specjax-cooccurrence"
PROGRESS = "progress.json"
REBUILD_GRAPH = "rebuild it with `specjax build-graph`"
STATE = "bigrams.npz"


def _merge(keys: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sum the counts of equal keys: (sorted unique keys, their counts)."""
    uniq, inv = np.unique(keys, return_inverse=True)
    return uniq, np.bincount(inv, weights=counts, minlength=uniq.size).astype(np.int64)


def count_bigrams(tokenizer: Any, docs: Iterable[str], *, vocab_size: int,
                  out_dir: str | Path | None, corpus: str, batch_size: int = 64,
                  checkpoint_every: int = 2000, total: int | None = None,
                  progress: bool = True) -> tuple[np.ndarray, np.ndarray, int]:
    """Bigram counts of ``docs`` (within each document): (keys u*V+v, counts, tokens).

    Resumable through ``out_dir`` like :func:`specjax.vocab.corpus_counts.count_tokens`:
    ``docs`` must yield the same documents in the same order on a rerun.
    """
    from tqdm.auto import tqdm

    from specjax.vocab.corpus_counts import _encode_batch, tokenizer_fingerprint

    v = int(vocab_size)
    fp = tokenizer_fingerprint(tokenizer)
    keys, counts = np.zeros(0, np.int64), np.zeros(0, np.int64)
    done = tokens = 0
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        if (out / PROGRESS).exists():
            prog = json.loads((out / PROGRESS).read_text())
            if (prog.get("format") != GRAPH_FORMAT + "-progress" or prog["corpus"] != corpus
                    or prog["tokenizer_fingerprint"] != fp or prog["vocab_size"] != v):
                raise ValueError(f"{out} holds bigram counts of another corpus, tokenizer or "
                                 "vocabulary; choose another output or delete it")
            with np.load(out / STATE) as z:
                keys, counts = z["keys"], z["counts"]
            if sha256(counts) != prog["counts_sha256"]:
                raise ValueError(f"{out / STATE} does not match {PROGRESS}; delete {out} to "
                                 "count again")
            done, tokens = prog["docs"], prog["tokens"]

    def save() -> None:
        if out is None:
            return
        import io

        buf = io.BytesIO()
        np.savez(buf, keys=keys, counts=counts)
        atomic_write_bytes(out / STATE, buf.getvalue())
        write_json_atomic(out / PROGRESS, {
            "format": GRAPH_FORMAT + "-progress", "version": VERSION, "corpus": corpus,
            "tokenizer_fingerprint": fp, "vocab_size": v, "docs": done, "tokens": tokens,
            "counts_sha256": sha256(counts), "updated": time.strftime("%Y-%m-%dT%H:%M:%S")})

    it = iter(docs)
    if sum(1 for _ in itertools.islice(it, done)) < done:
        raise ValueError(f"{out} counted {done} documents but this corpus has fewer")
    bar = tqdm(total=total, initial=done, unit="doc", desc="counting bigrams",
               disable=not progress, dynamic_ncols=True)
    pending_k: list[np.ndarray] = []
    last_save = done

    def fold() -> tuple[np.ndarray, np.ndarray]:
        """The counts so far with the pending pairs added (one count each)."""
        merged = _merge(np.concatenate([keys, *pending_k]),
                        np.concatenate([counts, *(np.ones(k.size, np.int64) for k in pending_k)]))
        pending_k.clear()
        return merged
    for batch in iter(lambda: list(itertools.islice(it, batch_size)), []):
        for ids in _encode_batch(tokenizer, batch):
            a = np.asarray(ids, np.int64)
            if a.size and a.max() >= v:
                raise ValueError(f"the tokenizer produced id {int(a.max())} >= {v}; pass the "
                                 "model's vocab_size")
            tokens += a.size
            if a.size > 1:
                pending_k.append(a[:-1] * v + a[1:])
        done += len(batch)
        bar.update(len(batch))
        if sum(k.size for k in pending_k) > 2_000_000 or done - last_save >= checkpoint_every:
            keys, counts = fold()
            bar.set_postfix(tokens=f"{tokens:,}", pairs=f"{keys.size:,}", refresh=False)
            if done - last_save >= checkpoint_every:
                save()
                last_save = done
    keys, counts = fold()
    save()
    bar.close()
    return keys, counts, tokens


def successor_table(keys: np.ndarray, counts: np.ndarray, vocab_size: int, *,
                    min_count: int = 5, min_prob: float = 1e-4,
                    max_degree: int = 64) -> np.ndarray:
    """[V, max_degree] int32 successors by decreasing p(v | u) (ties: smaller id), -1-padded.

    p(v | u) = count(u, v) / count(u, .), the denominator over every bigram from u, before
    pruning; an edge needs ``count >= min_count`` and ``p >= min_prob``.
    """
    v = int(vocab_size)
    u, w = keys // v, keys % v
    out_deg = np.bincount(u, weights=counts, minlength=v)
    p = counts / np.maximum(out_deg[u], 1)
    keep = (counts >= min_count) & (p >= min_prob)
    u, w, p = u[keep], w[keep], p[keep]
    order = np.lexsort((w, -p, u))  # by source, then p descending, then id
    u, w = u[order], w[order]
    rank = np.arange(u.size) - np.searchsorted(u, u, side="left")
    keep = rank < max_degree
    table = np.full((v, max_degree), -1, np.int32)
    table[u[keep], rank[keep]] = w[keep]
    return table


def save_graph(path: str | Path, table: np.ndarray, meta: dict) -> Path:
    """Write the graph pair (array, then sidecar); returns the .npy path."""
    npy, side = pair(path)
    npy.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(npy, npy_bytes(table.astype(np.int32)))
    write_json_atomic(side, {**meta, "format": GRAPH_FORMAT, "version": VERSION,
                             "vocab_size": int(table.shape[0]),
                             "max_degree": int(table.shape[1]), "sha256": sha256(table),
                             "edges": int(np.sum(table >= 0))})
    return npy


def load_graph(path: str | Path, *, vocab_size: int | None = None,
               fingerprint: str | None = None) -> np.ndarray:
    """[V, S] int32 successors; refused for another vocabulary or tokenizer, or if damaged."""
    npy, side = pair(path)
    meta = read_sidecar(npy, side, GRAPH_FORMAT, "co-occurrence graph", REBUILD_GRAPH)
    check_model(npy, meta, vocab_size, fingerprint, "co-occurrence graph", REBUILD_GRAPH)
    table = np.load(npy, allow_pickle=False)
    if sha256(table) != meta["sha256"] or table.ndim != 2:
        raise ValueError(f"{npy} does not match its sidecar (edited or damaged); rebuild it "
                         "with `specjax build-graph`")
    if table.min(initial=0) < -1 or table.max(initial=0) >= table.shape[0]:
        raise ValueError(f"{npy} holds ids outside [0, {table.shape[0]}); rebuild it")
    return table


# --------------------------------------------------------------------------- command


def add_parser(subparsers: Any) -> Any:
    """Add ``build-graph`` to a parser's subparsers; ``args.run`` runs it."""
    import argparse

    p = subparsers.add_parser("build-graph", help="EvoSpec: build the token co-occurrence graph",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="converted target folder (default: "
                   "SmolLM2-135M-Instruct)")
    p.add_argument("--corpus", default="sharegpt",
                   help="'sharegpt' or a .txt / .jsonl file (as build-shortlist)")
    p.add_argument("--max-docs", type=int, default=None)
    p.add_argument("--out", required=True,
                   help="graph path NAME (writes NAME.npy + NAME.json; NAME.counting/ holds "
                        "the resumable counts)")
    p.add_argument("--min-count", type=int, default=5)
    p.add_argument("--min-prob", type=float, default=1e-4)
    p.add_argument("--max-degree", type=int, default=64)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run_build_graph)
    return p


def run_build_graph(args: Any) -> int:
    """``specjax build-graph``: count a corpus's token co-occurrences with the model's
    tokenizer and write the pruned graph; returns the exit code.

    Raises:
      ValueError: a threshold out of range, or a model folder without a tokenizer.
    """
    from specjax.vocab.build_shortlist import _command_line, _load_model
    from specjax.vocab.corpus_counts import (
        corpus_description,
        iter_corpus,
        tokenizer_fingerprint,
    )

    if args.min_count < 1 or not 0 <= args.min_prob <= 1 or args.max_degree < 1:
        raise ValueError("--min-count and --max-degree must be >= 1, --min-prob in [0, 1]")
    model_dir, cfg, tok = _load_model(args.model, not args.no_progress)
    if tok is None:
        raise ValueError(f"{model_dir} has no tokenizer to count with")
    npy, _ = pair(args.out)
    docs = iter_corpus(args.corpus, tok)
    if args.max_docs is not None:
        docs = itertools.islice(docs, args.max_docs)
    corpus = corpus_description(args.corpus, tok) + (
        f" first {args.max_docs} docs" if args.max_docs is not None else "")
    t0 = time.time()
    keys, counts, tokens = count_bigrams(
        tok, docs, vocab_size=cfg.vocab_size, out_dir=npy.with_suffix(".counting"),
        corpus=corpus, total=args.max_docs, progress=not args.no_progress)
    table = successor_table(keys, counts, cfg.vocab_size, min_count=args.min_count,
                            min_prob=args.min_prob, max_degree=args.max_degree)
    path = save_graph(args.out, table, {
        "tokenizer_fingerprint": tokenizer_fingerprint(tok), "source": corpus,
        "tokens": int(tokens), "pairs": int(keys.size), "min_count": args.min_count,
        "min_prob": args.min_prob, "command": _command_line(args), "model": model_dir.name,
        "build_s": round(time.time() - t0, 1)})
    deg = np.sum(table >= 0, axis=1)
    print(f"wrote {path}: {int(deg.sum()):,} edges over {int(np.sum(deg > 0)):,} source tokens "
          f"(mean out-degree {deg[deg > 0].mean() if deg.any() else 0:.1f}) from "
          f"{tokens:,} tokens")
    return 0
