"""The ``specjax`` commands that belong to no other package: convert, generate, bench.

Each command module exposes ``add_parser(subparsers)``, which adds the command's parser and
sets ``run`` (parsed flags -> exit code) as its default; :func:`specjax.cli.main` calls it.
The other commands follow the same pattern where their code lives:
:mod:`specjax.train.cli` (``train``) and :mod:`specjax.vocab.build_shortlist`
(``build-shortlist``).
"""
