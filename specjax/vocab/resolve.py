"""Turn a ``--vocab`` spec into a :class:`~specjax.vocab.head.VocabHead` for a target and drafter.

Specs (artifacts default to the drafter's folder, where the shipped SmolLM2 drafter keeps
``freq_counts.npy`` and ``router/``):

* ``full``: the whole vocabulary (EAGLE-2);
* ``fr:N[:PATH]``: FR-Spec, the N most frequent tokens; PATH is a count file
  (``specjax build-shortlist``), one of its ``fr_N.npy`` lists, or an imported list
  (FR-Spec ``freq_V.pt``, an SGLang token map, ``.npy``/``.json``);
* ``pafr:N[:PATH]``: PA-FR, the same ranking with the position-aware budget K_fr(t);
* ``dynaspec[:PATH]``: DynaSpec with the position-aware cluster budget k_c(t);
  ``dynaspec-f[:PATH]``: a fixed top-k of clusters. The budgets are the router's
  (``specjax train router``); append ``-shared`` (``dynaspec-shared``) for one shortlist
  per draft step shared by the step's nodes.
* ``evospec[:NS+ND[:GRAPH]]``: EvoSpec, a static FR-Spec core of NS tokens plus a dynamic
  buffer of ND (default ``8192+256``); GRAPH is a co-occurrence graph (``specjax
  build-graph``; default the drafter folder's ``cooccurrence.npy``), or ``none``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specjax._checks import check_text
from specjax.loaded import Drafter, Target
from specjax.vocab.head import VocabHead, full_head


def always_kept(target: Target) -> list[int]:
    """EOS ids and the chat template's special tokens: in every shortlist."""
    from specjax.vocab.corpus_counts import required_tokens

    if target.tokenizer is None:
        return list(target.eos_ids)
    return required_tokens(target.tokenizer, target.eos_ids)


def _artifact(arg: str, drafter: Drafter, name: str, how: str) -> Path:
    if arg:
        return Path(arg)
    where = "this drafter was not loaded from a folder" if drafter.path is None \
        else f"the drafter folder {drafter.path} has no {name}"
    if drafter.path is None or not (Path(drafter.path) / name).exists():
        raise ValueError(f"{where}; {how}")
    return Path(drafter.path) / name


def frequency_ranking(path: Path, target: Target) -> np.ndarray:
    """Token ids by decreasing frequency, from a count file or a (possibly imported) list."""
    from specjax.vocab.corpus_counts import COUNTS_FORMAT, load_counts, tokenizer_fingerprint
    from specjax.vocab.shortlist import (
        SHORTLIST_FORMAT,
        import_token_list,
        load_shortlist,
        sidecar_format,
    )

    v = target.cfg.vocab_size
    fp = tokenizer_fingerprint(target.tokenizer) if target.tokenizer is not None else None
    sidecar = sidecar_format(path)
    if sidecar == COUNTS_FORMAT:
        counts = load_counts(path, vocab_size=v, fingerprint=fp).counts
        return np.argsort(-counts, kind="stable")
    if sidecar == SHORTLIST_FORMAT:
        return load_shortlist(path, vocab_size=v, fingerprint=fp, eos_ids=target.eos_ids).ids
    return import_token_list(path, vocab_size=v).ids


def resolve_head(spec: str | VocabHead, target: Target, drafter: Drafter) -> VocabHead:
    """The head ``spec`` names (see the module doc), built for ``target`` and ``drafter``.

    A :class:`VocabHead` is returned as is. Raises ValueError for an unknown spec, a
    missing artifact, or one built for another tokenizer, target or drafter.
    """
    if not isinstance(spec, str):
        return spec
    spec = check_text("vocab", spec)
    name, _, arg = spec.partition(":")
    if getattr(drafter.cfg, "kind", "eagle") == "eagle3":
        # An EAGLE-3 drafter was trained with its own head over its own draft vocabulary;
        # the shortlist heads score the target's head, which it never learned to feed.
        if spec != "full":
            raise ValueError(f"vocab {spec!r}: an EAGLE-3 drafter drafts over its own "
                             f"{drafter.cfg.draft_vocab_size}-token vocabulary; use 'full' "
                             "(FR-Spec and DynaSpec heads apply to EAGLE-1/2 drafters)")
        from specjax.eagle3 import Eagle3Head

        return Eagle3Head.of(drafter.params, drafter.cfg)
    if name == "full" and not arg:
        return full_head(target.cfg.vocab_size)
    if name in ("fr", "pafr"):
        from specjax.vocab.fr_head import frequency_head

        size, _, path = arg.partition(":")
        if not (size.isascii() and size.isdigit()) or int(size) < 1:
            raise ValueError(f"vocab {spec!r}: expected {name}:N[:PATH] with N >= 1 the "
                             "shortlist size, e.g. fr:32768")
        v = target.cfg.vocab_size
        if int(size) > v:
            raise ValueError(f"vocab {spec!r}: N={int(size)} exceeds the vocabulary's {v} "
                             f"tokens; use N <= {v}, or 'full' for the whole vocabulary")
        path = _artifact(path, drafter, "freq_counts.npy",
                         f"pass {name}:{size}:PATH with counts from `specjax build-shortlist`")
        return frequency_head(target.params.head, frequency_ranking(path, target),
                              always_kept(target), int(size), position_aware=name == "pafr")
    if name == "evospec":
        return _evospec(spec, arg, target, drafter)
    base = name.removesuffix("-shared")
    if base in ("dynaspec", "dynaspec-f"):
        return _routed(Path(_artifact(arg, drafter, "router",
                                      "train one with `specjax train router`")),
                       target, drafter, position_aware=base == "dynaspec",
                       shared=name.endswith("-shared"))
    raise ValueError(f"unknown vocab {spec!r}; use full, fr:N, pafr:N, dynaspec[:ROUTER], "
                     "dynaspec-f[:ROUTER] or evospec[:NS+ND[:GRAPH]]")


EVOSPEC_DEFAULT = (8192, 256)


def _evospec(spec: str, arg: str, target: Target, drafter: Drafter):
    from specjax.vocab.cooccurrence import load_graph
    from specjax.vocab.corpus_counts import tokenizer_fingerprint
    from specjax.vocab.evospec import evospec_head

    sizes, _, graph = arg.partition(":")
    n_static, n_dyn = EVOSPEC_DEFAULT
    if sizes:
        a, plus, b = sizes.partition("+")
        if not (plus and a.isascii() and a.isdigit() and b.isascii() and b.isdigit()):
            raise ValueError(f"vocab {spec!r}: expected evospec:NS+ND[:GRAPH], e.g. "
                             "evospec:8192+256 (NS static core tokens, ND dynamic buffer)")
        n_static, n_dyn = int(a), int(b)
    counts = _artifact("", drafter, "freq_counts.npy",
                       "EvoSpec's core is an FR-Spec ranking; build counts with "
                       "`specjax build-shortlist` and put freq_counts.npy in the drafter folder")
    successors = None
    if graph != "none":
        path = _artifact(graph, drafter, "cooccurrence.npy",
                         f"build one with `specjax build-graph --out DRAFTER/cooccurrence`, "
                         f"pass evospec:{n_static}+{n_dyn}:PATH, or :none for no graph")
        fp = tokenizer_fingerprint(target.tokenizer) if target.tokenizer is not None else None
        successors = load_graph(path, vocab_size=target.cfg.vocab_size, fingerprint=fp)
    try:
        return evospec_head(target.params.head, frequency_ranking(counts, target),
                            always_kept(target), n_static, n_dyn=n_dyn, successors=successors)
    except ValueError as e:
        raise ValueError(f"vocab {spec!r}: {e}") from e


def _routed(path: Path, target: Target, drafter: Drafter, *, position_aware: bool, shared: bool):
    from specjax.vocab.dynaspec import routed_head
    from specjax.vocab.router import fingerprint, load_router, target_fields_of

    _, params, clusters, meta = load_router(
        path, drafter_fingerprint=fingerprint(drafter.params),
        target_fields=target_fields_of(target.cfg), dtype=str(target.params.embed.dtype))
    budget = meta.get("budget", {})
    k0 = budget.get("k0" if position_aware else "k_fixed")
    if k0 is None:
        raise ValueError(f"{path} records no cluster budget ('budget' in its manifest); "
                         "build the head with specjax.vocab.dynaspec.routed_head(...)")
    return routed_head(params, clusters, always_kept(target), k0=k0,
                       k1=budget.get("k1", 0), position_aware=position_aware, shared=shared,
                       cluster_cap=budget.get("cluster_cap", 0))
