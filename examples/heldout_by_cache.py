"""Held-out top-1 of drafters on each hidden-state cache's held-out split, one by one.

Training reports one number over the concatenated held-out sets of all its caches; this
separates them (e.g. short self-distilled answers against long-context ones), scoring the
whole vocabulary as training's evaluation does.

    python examples/heldout_by_cache.py --cache cacheA --cache cacheB --drafter D1 --drafter D2
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flax import nnx

import specjax
from specjax.bench.common import write_json
from specjax.checkpoint import read_manifest
from specjax.defaults import resolve_model, shipped_drafter_for
from specjax.drafter import FORMAT, DrafterConfig
from specjax.train.data import load_split
from specjax.train.drafter import (
    TrainConfig,
    compiled_steps,
    evaluate,
    init_drafter,
    load_weights_into,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target (default: SmolLM2)")
    ap.add_argument("--cache", action="append", required=True, help="hidden-state cache (repeat)")
    ap.add_argument("--drafter", action="append", default=None,
                    help="drafter folder (repeat; default: the shipped one)")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args()
    target = specjax.load(resolve_model(args.model, progress=False))
    splits = {c: load_split(Path(c), "heldout") for c in args.cache}
    result: dict[str, dict] = {}
    for path in args.drafter or [str(shipped_drafter_for(target.cfg))]:
        cfg = DrafterConfig.from_json(read_manifest(Path(path), FORMAT)["config"])
        tc = TrainConfig(ce_weight=0.5, drafter_taps=tuple(cfg.taps),
                         drafter_layers=cfg.num_layers)
        model = init_drafter(target.cfg, target.params, tc)
        load_weights_into(model, Path(path), target.cfg)
        graphdef, params = nnx.split(model, nnx.Param)
        eval_step = compiled_steps(graphdef, tc, 1)[2]
        for cache, split in splits.items():
            r = evaluate(eval_step, params, target.params.embed, target.params.head, split,
                         2048, tc.ce_weight)
            result.setdefault(path, {})[cache] = {"top1": r["top1"], "rows": r["rows"],
                                                  "conversations": len(split)}
            print(f"{path} {cache}: top-1 {r['top1']:.4f} over {r['rows']} rows "
                  f"({len(split)} conversations)", flush=True)
    if args.out:
        write_json(Path(args.out), result)


if __name__ == "__main__":
    main()
