"""``specjax bench``: the benchmarks, one subcommand each (see :mod:`specjax.bench`)."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``bench`` and its subcommands to a parser's subparsers; each sets ``args.run``."""
    from specjax.bench import (
        batch,
        breakdown,
        decode,
        evospec,
        gemm,
        lane,
        latency,
        mips,
        oracle,
        spec_cli,
        tree_compare,
        vocab,
    )

    b = subparsers.add_parser("bench", help="benchmarks (results as JSON + plot)")
    bench = b.add_subparsers(dest="bench", required=True)
    for module in (decode, spec_cli, batch, tree_compare, breakdown, vocab, gemm, latency, oracle,
                   evospec, mips, lane):
        module.add_parser(bench)
    return b
