"""``specjax bench all --out DIR``: the benchmark lane in one command (decode, spec, vocab,
gemm, trees), for a machine one has briefly, such as a lent GPU.

Each benchmark runs with its own defaults (plus ``--model``/``--drafter`` where it takes
them) and writes ``DIR/bench_<name>.json`` and its plots. One failing benchmark does not
stop the others: its error goes to ``DIR/summary.json``, which also lists every file
written with its size, and flags any over ``--max-file-mib`` (16 MiB: what a lent
machine sends back per file). A rerun resumes the benchmarks that resume (spec, trees,
vocab keep partial files) and skips those already finished, unless ``--force``.
"""

from __future__ import annotations

import argparse
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# name -> (bench subcommand, whether it takes --model/--drafter).
LANE = {"decode": ("decode", False), "spec": ("spec", True), "vocab": ("vocab", True),
        "gemm": ("gemm", False), "trees": ("trees", True)}


def run_all(out: Path, *, only: Sequence[str] = tuple(LANE), model: str | None = None,
            drafter: str | None = None, max_file_mib: float = 16.0,
            force: bool = False) -> dict[str, Any]:
    """Run the lane's benchmarks into ``out``; returns (and writes) the summary."""
    from specjax.bench.common import machine_info, write_json
    from specjax.cli import build_parser

    unknown = sorted(set(only) - set(LANE))
    if unknown:
        raise ValueError(f"unknown benchmark(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(LANE)}")
    out.mkdir(parents=True, exist_ok=True)
    parser = build_parser()
    summary: dict[str, Any] = {"machine": machine_info(), "runs": {}}
    for name in only:
        command, takes_model = LANE[name]
        result = out / f"bench_{name}.json"
        if result.exists() and not force:
            summary["runs"][name] = {"status": "done earlier", "out": result.name}
            continue
        argv = ["bench", command, "--out", str(result)]
        if takes_model:
            argv += ["--model", model] if model else []
            argv += ["--drafter", drafter] if drafter else []
        t0 = time.perf_counter()
        try:
            args = parser.parse_args(argv)
            code = args.run(args)
            status = "ok" if code == 0 else f"exit {code}"
        except Exception as e:  # noqa: BLE001  (one benchmark's failure must not stop the lane)
            status = f"failed: {type(e).__name__}: {e}"
            (out / f"bench_{name}.error.txt").write_text(traceback.format_exc())
        summary["runs"][name] = {"status": status, "seconds": round(time.perf_counter() - t0, 1),
                                 "argv": argv}
        write_json(out / "summary.json", summary)
    limit = int(max_file_mib * 2**20)
    files = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*"))
             if p.is_file()}
    summary["files"] = files
    summary["too_large"] = [f for f, size in files.items() if size > limit]
    write_json(out / "summary.json", summary)
    return summary


def add_parser(bench: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``all`` to ``specjax bench``'s subparsers; ``args.run`` runs it."""
    p = bench.add_parser("all", help="decode, spec, vocab, gemm and trees into one folder",
                         description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for every benchmark's JSON and plots")
    p.add_argument("--only", default=",".join(LANE),
                   help=f"comma-separated subset of {', '.join(LANE)}")
    p.add_argument("--model", default=None)
    p.add_argument("--drafter", default=None)
    p.add_argument("--max-file-mib", type=float, default=16.0)
    p.add_argument("--force", action="store_true", help="rerun benchmarks already finished")
    p.set_defaults(run=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    import json

    only = [s.strip() for s in args.only.split(",") if s.strip()]
    s = run_all(Path(args.out), only=only, model=args.model, drafter=args.drafter,
                max_file_mib=args.max_file_mib, force=args.force)
    print(json.dumps({"runs": {k: v["status"] for k, v in s["runs"].items()},
                      "too_large": s["too_large"]}, indent=1))
    failed = [k for k, v in s["runs"].items() if v["status"] not in ("ok", "done earlier")]
    return 1 if failed or s["too_large"] else 0
