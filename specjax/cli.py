"""``specjax`` command line: convert, generate, chat, bench, train, build-shortlist,
build-graph, env."""

from __future__ import annotations

import argparse
import math
import sys


def build_parser() -> argparse.ArgumentParser:
    """The ``specjax`` parser.

    Every command module exposes ``add_parser(subparsers)``, which adds the command's
    parser and sets ``run`` (parsed flags -> exit code) as its default, so :func:`main`
    runs any command as ``args.run(args)``.
    """
    from specjax.commands import bench, chat, convert, env, generate
    from specjax.train import cli as train
    from specjax.vocab import build_shortlist, cooccurrence

    parser = argparse.ArgumentParser(prog="specjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (convert, generate, chat, bench, train, build_shortlist, cooccurrence, env):
        command.add_parser(sub)
    return parser


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
        return args.run(args)
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


if __name__ == "__main__":
    sys.exit(main())
