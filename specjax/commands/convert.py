"""``specjax convert``: an HF folder or a GGUF file -> a specjax checkpoint folder."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``convert`` to a parser's subparsers; ``args.run`` runs it."""
    p = subparsers.add_parser("convert", help="convert an HF folder or a .gguf file")
    p.add_argument("src", help="HF model folder (config.json + *.safetensors) or a .gguf file")
    p.add_argument("out", help="folder to create")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="for a .gguf: HF tokenizer files to use instead of its metadata's")
    p.set_defaults(run=run_convert)
    return p


def run_convert(args: argparse.Namespace) -> int:
    """Run ``specjax convert``; returns the exit code."""
    import specjax

    out = specjax.convert(args.src, args.out, overwrite=args.overwrite, dtype=args.dtype,
                          tokenizer=args.tokenizer)
    print(f"wrote {out}")
    return 0
