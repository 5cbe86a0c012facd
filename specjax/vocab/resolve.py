"""Turn a ``--vocab`` spec into a :class:`~specjax.vocab.head.VocabHead`."""

from __future__ import annotations

from typing import Any

from specjax.vocab.head import VocabHead, full_head


def resolve_head(spec: str | VocabHead, target: Any, drafter: Any) -> VocabHead:
    """The head a spec names, built for ``target`` and ``drafter``."""
    if not isinstance(spec, str):
        return spec
    name, _, arg = spec.partition(":")
    if name == "full" and not arg:
        return full_head(target.cfg.vocab_size)
    raise ValueError(f"unknown vocabulary head {spec!r}")
