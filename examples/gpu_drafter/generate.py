"""GPU side, step 1: the target's answers to the stages ``prepare.py`` wrote (resumable).

Each stage appends to ``OUT_DIR/<stage>.jsonl`` through ``generate_self_distill`` with the
specjax engine, one batch at a time, so a run stopped by its time limit keeps every batch
it finished and a rerun goes on from there. Prompts are shuffled by ``prepare.py`` so every
batch pads to the same bucket: one compiled program per stage.

    python examples/gpu_drafter/generate.py --prompts .gpu/payload/prompts.json.xz \\
        --target TARGET_DIR --out-dir OUT_DIR [--stages greedy_new,greedy_long]

Between GPU sessions the CPU can answer some stages of the same pool ahead of time
(``--engine transformers``, about twice the specjax engine's rate on a CPU); keep the pool
beside the answers, and ``prepare.py --answers OUT_DIR POOL`` trains on them next time
instead of asking the GPU for them.
"""

from __future__ import annotations

import argparse
import json
import lzma
import sys
import time
from pathlib import Path

import specjax
from specjax.train.selfdistill import generate_self_distill


def stage_batch(stage: dict, batch: int | None = None, scale: int = 1) -> int:
    """Prompts a call answers for ``stage``: ``batch`` for every stage, else the stage's
    own batch (``prepare.py``'s, sized for short or long prompts) times ``scale``."""
    return batch if batch is not None else stage["batch"] * scale


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--stages", default=None, help="comma-separated stage names (default all)")
    ap.add_argument("--limit", type=int, default=None, help="prompts per stage at most (toy runs)")
    ap.add_argument("--batch", type=int, default=None, help="override every stage's batch")
    ap.add_argument("--batch-scale", type=int, default=1,
                    help="multiply every stage's own batch (a GPU with memory to spare)")
    ap.add_argument("--engine", choices=("specjax", "transformers"), default="specjax",
                    help="specjax (the GPU's) or transformers (faster on a CPU; needs torch)")
    args = ap.parse_args()
    if args.batch_scale < 1 or (args.batch is not None and args.batch < 1):
        ap.error("--batch and --batch-scale must be >= 1")
    if args.batch is not None and args.batch_scale != 1:
        ap.error("give --batch (one batch for every stage) or --batch-scale, not both")

    spec = json.loads(lzma.open(args.prompts, "rt").read())
    target = specjax.load(args.target)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    wanted = None if args.stages is None else set(args.stages.split(","))
    for stage in spec["stages"]:
        if wanted is not None and stage["name"] not in wanted:
            continue
        batch = stage_batch(stage, args.batch, args.batch_scale)
        ids = stage["prompts"][: args.limit]
        if len(ids) > batch:  # whole batches only: a last, smaller one is another compile
            ids = ids[: len(ids) // batch * batch]
        if not ids:  # e.g. no followup prompts were prepared
            continue
        prompts = [spec["pool"][i] for i in ids]
        t0 = time.time()
        meta = generate_self_distill(
            target, prompts, args.out_dir / f"{stage['name']}.jsonl",
            max_new_tokens=stage["max_new_tokens"], batch_size=batch, engine=args.engine,
            temperature=stage["temperature"], seed=stage["seed"],
            source=f"{spec['source']}; stage {stage['name']}", progress=True)
        dt = time.time() - t0
        print(json.dumps({"stage": stage["name"], "records": meta["records"],
                          "answer_tokens": meta["answer_tokens"], "finished": meta["finished"],
                          "seconds": round(dt, 1)}), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
