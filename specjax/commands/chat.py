"""``specjax chat``: a multi-turn conversation in the terminal, speculative decoding throughout.

Each turn renders the whole conversation with the chat template and generates the reply.
A stateful vocabulary head (``--vocab evospec``, the default here) keeps its state across
turns, so the dynamic vocabulary grows with the conversation, and ``--adapt lora`` aligns
the drafter online (:mod:`specjax.train.online_session`). After every reply a line shows
the turn's acceptance (tokens per target forward), for EvoSpec the OOV events, insertions
and evictions of the turn and the buffer's occupancy, and with LoRA the updates so far
(and, with the guard, whether the adapter or the frozen drafter drafts the next turn).
Empty line or ``/quit`` ends; ``/reset`` forgets the conversation (the buffer and the
deltas stay: they are what the session learned); ``/new`` starts a new conversation and
forgets what the session learned too (an adapter fitted to one conversation lowers
acceptance in an unrelated next one; one session per conversation gains, late in long
conversations: docs/benchmarks.md, the thirty-fourth to thirty-sixth sessions).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from specjax.commands.generate import _add_model, _add_sampling, _add_tree, _resolve_drafter, _tree


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``chat`` to a parser's subparsers; ``args.run`` runs it."""
    p = subparsers.add_parser("chat", help="an interactive conversation (EvoSpec adapts across "
                              "turns)", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model(p)
    _add_sampling(p)
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--drafter", default=None,
                   help="drafter folder (default: the shipped drafter with the default model)")
    _add_tree(p)
    p.add_argument("--vocab", default="evospec",
                   help="drafter vocabulary head (default evospec; see specjax generate)")
    p.add_argument("--adapt", default="none", choices=["none", "lora"],
                   help="online alignment of the drafter: lora = EvoSpec's LoRA on W_q, W_v "
                        "(rank 32), updated from each turn's verified text")
    # The measured setting on SmolLM2 (docs/benchmarks.md, thirty-fourth to thirty-seventh
    # sessions), not the paper's 1e-5 and one step, under which no draft changes here.
    p.add_argument("--lora-lr", type=float, default=1e-3,
                   help="--adapt lora: the adapter's Adam learning rate (default 1e-3; the "
                        "paper's 1e-5 moves no draft of a 135M drafter)")
    p.add_argument("--steps-per-update", type=int, default=8,
                   help="--adapt lora: optax steps on each full replay buffer (default 8)")
    # Off by default: on the streams measured it neither cut losses nor raised the gain.
    p.add_argument("--guard", action=argparse.BooleanOptionalAction, default=False,
                   help="--adapt lora: the adapter drafts a turn only after it beat the frozen "
                        "drafter on the turn before (default off: it always drafts)")
    p.set_defaults(run=run_chat)
    return p


def turn_line(stats: dict[str, Any], before: dict[str, Any] | None,
              updates: int | None = None, deployed: bool | None = None) -> str:
    """The line printed after a reply: acceptance, what the buffer did, LoRA updates, and
    (``deployed`` not None: a guarded session) which drafter drafts the next turn."""
    line = f"[{stats['new_tokens']} tokens, {stats['decode_tokens_per_s']:.1f} tok/s"
    if "mean_accepted_length" in stats:
        line += f", {stats['mean_accepted_length']:.2f} tokens per target forward"
    if "oov_events" in stats:
        prev = before or {"oov_events": [0], "insertions": [0], "evictions": [0]}
        line += (f", OOV events {stats['oov_events'][0] - prev['oov_events'][0]}"
                 f", inserted {stats['insertions'][0] - prev['insertions'][0]}"
                 f", evicted {stats['evictions'][0] - prev['evictions'][0]}"
                 f", buffer {stats['buffer_occupancy'][0]}")
    if updates is not None:
        line += f", LoRA updates {updates}"
    if deployed is not None:
        line += ", next turn: " + ("adapter" if deployed else "frozen drafter (guard)")
    return line + "]"


def chat_loop(target: Any, drafter: Any, kwargs: dict[str, Any], system: str | None,
              lines: TextIO, out: TextIO, err: TextIO, adapt: bool = False,
              online: Any = None) -> int:
    """Read user turns from ``lines`` until EOF / empty / ``/quit``; returns turns answered.
    ``online``: the OnlineConfig of ``adapt`` (None: its defaults, the paper's)."""
    import specjax
    from specjax.tokenizer import render_chat
    from specjax.train.online import OnlineConfig
    from specjax.train.online_session import OnlineSession
    from specjax.vocab import resolve_head

    vocab, online = kwargs.pop("vocab"), online or OnlineConfig()
    session = None if drafter is None else OnlineSession(
        target, drafter, resolve_head(vocab, target, drafter), oc=online, adapt=adapt)
    start = [] if system is None else [{"role": "system", "content": system}]
    messages, before, turns = list(start), None, 0
    while True:
        print("> ", end="", file=err, flush=True)
        user = lines.readline()
        if not user or not user.strip() or user.strip() == "/quit":
            return turns
        if user.strip() == "/reset":
            messages = list(start)
            print("[conversation reset; the vocabulary buffer and LoRA deltas are kept]",
                  file=err)
            continue
        if user.strip() == "/new":
            messages, before = list(start), None  # the buffer's counters restart too
            if session is not None:
                session.reset()
            print("[new conversation; the vocabulary buffer and LoRA deltas are reset]",
                  file=err)
            continue
        messages.append({"role": "user", "content": user.rstrip("\n")})
        ids = [list(render_chat(target.tokenizer, messages, where=str(target.path),
                                tokenize=True, add_generation_prompt=True, return_dict=False))]
        res = (specjax.generate(target, ids, **kwargs) if session is None
               else session.generate(ids, **kwargs))
        print(res.text, file=out, flush=True)
        messages.append({"role": "assistant", "content": res.text})
        print(turn_line(res.stats, before, session.stats["updates"] if adapt else None,
                        session.deployed if adapt and online.guard else None), file=err)
        before, turns = res.stats, turns + 1


def run_chat(args: argparse.Namespace) -> int:
    """``specjax chat``: the conversation loop in the terminal (turns read from stdin),
    speculative throughout, the drafter optionally aligned online (``--adapt lora``);
    returns the exit code.

    Raises:
      ValueError: a flag out of range (named in the message).
    """
    import specjax
    from specjax.compile_cache import enable_compilation_cache
    from specjax.defaults import resolve_model

    enable_compilation_cache()
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be >= 1")
    if args.steps_per_update < 1 or args.lora_lr <= 0:
        raise ValueError(f"--steps-per-update must be >= 1 and --lora-lr > 0, got "
                         f"{args.steps_per_update} and {args.lora_lr}")
    from specjax.train.online import OnlineConfig

    online = OnlineConfig(lr=args.lora_lr, steps_per_update=args.steps_per_update,
                          guard=args.guard)
    target = specjax.load(resolve_model(args.model), dtype=args.dtype)
    if target.tokenizer is None:
        raise ValueError(f"{args.model}: chat needs the model's tokenizer and chat template")
    drafter = _resolve_drafter(args, target)
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                  tree=None if drafter is None else _tree(args, drafter), vocab=args.vocab)
    if drafter is None:
        kwargs.pop("tree")
        kwargs["vocab"] = "full"
    if args.adapt != "none" and drafter is None:
        raise ValueError("--adapt lora aligns a drafter; this run has none (--drafter none?)")
    chat_loop(target, drafter, kwargs, args.system, sys.stdin, sys.stdout, sys.stderr,
              adapt=args.adapt == "lora", online=online)
    return 0
