"""Draft-tree flags (``--tree`` and its sizes) and how a tree is named in results."""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any

from specjax.speculative import TreeSpec
from specjax.tree.default import sampled_tree_at

# ``--tree default``: the drafter's measured greedy tree, known once it is loaded.
DRAFTER_DEFAULT = "default"


def add_tree_args(p: argparse.ArgumentParser, *, auto: bool,
                  drafter_default: bool = False) -> None:
    """``--tree`` (+ depth / top-k / tokens); ``auto`` adds the measured choice,
    ``drafter_default`` the drafter's stored one (see :func:`resolve_tree`)."""
    choices = ["auto", "eagle2", "chain"] if auto else ["eagle2", "chain"]
    choices += [DRAFTER_DEFAULT] if drafter_default else []
    help_default = (f"; {DRAFTER_DEFAULT} = the drafter's measured greedy tree (its "
                    "default_tree.json)" if drafter_default else "")
    p.add_argument("--tree", default=choices[0], choices=choices,
                   help="draft tree" + (": auto = chosen from the measured latency curve and "
                                        "a calibration run (default)" if auto else
                                        f" (default {choices[0]})") + help_default)
    d = TreeSpec()
    p.add_argument("--tree-depth", type=int, default=None,
                   help=f"draft levels (default {d.depth})")
    p.add_argument("--tree-top-k", type=int, default=None,
                   help=f"EAGLE-2 beam width (default {d.top_k})")
    p.add_argument("--tree-tokens", type=int, default=None,
                   help=f"EAGLE-2 draft tokens per step, root excluded (default "
                        f"{d.total_tokens})")
    p.add_argument("--tree-json", default=None, metavar="JSON",
                   help="any draft tree as TreeSpec JSON, e.g. a drafter's measured default "
                        "from its default_tree.json (replaces --tree and its sizes)")
    p.add_argument("--tree-lookup", type=lookup_sizes, default=(),
                   help="graft a chain of this many tokens copied from the committed text "
                        "onto the tree (prompt lookup); with auto, a comma list: the grid "
                        "adds every tree with each size (default: none)")
    p.add_argument("--tree-lookup-min", type=partial(lookup_sizes, what="match lengths"),
                   default=(1,),
                   help="the shortest suffix match that grafts the lookup chain; a step with "
                        "none verifies the tree alone; with auto, a comma list: the grid adds "
                        "every chain with each (default 1)")


def lookup_sizes(text: str, what: str = "chain lengths") -> tuple[int, ...]:
    """``--tree-lookup``'s (``--tree-lookup-min``'s) value: comma-separated integers >= 1."""
    try:
        sizes = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"want {what} >= 1 such as 4 or 4,8; got {text!r}")
    return sizes


def tree_from_args(args: argparse.Namespace) -> TreeSpec | str | None:
    """The TreeSpec the flags name; None for ``--tree auto``; :data:`DRAFTER_DEFAULT` for
    ``--tree default`` (:func:`resolve_tree` reads it from the loaded drafter).

    Raises:
      ValueError: sizes with ``--tree auto``, lists with a fixed tree, ``--tree-json`` or
        ``--tree default`` with other tree flags, or JSON that is not a valid tree.
    """
    given = [f for f in ("tree_depth", "tree_top_k", "tree_tokens")
             if getattr(args, f) is not None]
    if args.tree_json is not None:
        if given or args.tree_lookup or args.tree_lookup_min != (1,):
            raise ValueError("--tree-json names the whole tree (its lookup included); drop "
                             "--tree-depth/--tree-top-k/--tree-tokens/--tree-lookup*")
        return TreeSpec.from_json_text(args.tree_json)
    if args.tree == DRAFTER_DEFAULT:
        if given or args.tree_lookup or args.tree_lookup_min != (1,):
            raise ValueError(f"--tree {DRAFTER_DEFAULT} names the whole tree (its lookup "
                             "included); drop --tree-depth/--tree-top-k/--tree-tokens/"
                             "--tree-lookup*")
        return DRAFTER_DEFAULT
    if args.tree == "auto":
        if given:
            raise ValueError("--tree-depth/--tree-top-k/--tree-tokens need --tree eagle2|chain")
        return None
    if len(args.tree_lookup) > 1 or len(args.tree_lookup_min) > 1:
        raise ValueError("a fixed --tree takes one --tree-lookup size and one "
                         "--tree-lookup-min; lists are for --tree auto")
    d = TreeSpec()
    return TreeSpec(kind=args.tree, lookup=args.tree_lookup[0] if args.tree_lookup else 0,
                    lookup_min=args.tree_lookup_min[0],
                    depth=d.depth if args.tree_depth is None else args.tree_depth,
                    top_k=d.top_k if args.tree_top_k is None else args.tree_top_k,
                    total_tokens=d.total_tokens if args.tree_tokens is None
                    else args.tree_tokens)


def resolve_tree(tree: TreeSpec | str | None, drafter: Any, *,
                 temperature: float = 0.0) -> TreeSpec:
    """``tree`` itself; :class:`TreeSpec`'s defaults for None; for
    :data:`DRAFTER_DEFAULT` the loaded ``drafter``'s measured greedy tree, or at
    ``temperature`` > 0 the tree it drafts when sampling at batch 1 (its tree for sampling
    measured nearest that temperature, else its greedy tree: ``Drafter.tree_for``).

    Raises:
      ValueError: the drafter has no measured tree (no default_tree.json in its folder).
    """
    if tree is None:
        return TreeSpec()
    if tree != DRAFTER_DEFAULT:
        return tree
    if temperature > 0 and (sampled := sampled_tree_at(drafter.sampled_trees, temperature)):
        return sampled
    if drafter.default_tree is None:
        raise ValueError(f"--tree {DRAFTER_DEFAULT}: the drafter "
                         f"{drafter.path or '(in memory)'} has no measured tree (no "
                         "default_tree.json); measure one with `specjax bench spec "
                         "--save-default-tree`, or name a tree with --tree-json")
    return drafter.default_tree


def tree_dict(tree: TreeSpec) -> dict[str, Any]:
    """A tree's fields plus its node count T (root included), for JSON."""
    return tree.to_json()


def tree_label(tree: TreeSpec) -> str:
    """A short name that fixes the tree's shape: ``eagle2 d4 k4 n8``, ``dyspec n8``, ...,
    then `` +lookup4`` for a grafted lookup chain (``+lookup4 m2``: grafted on a match of
    two tokens or more; ``+lookup4 m2 g5``: matching suffixes of up to five tokens, where
    the default is :attr:`TreeSpec.lookup_ngram`'s) and `` +copy8`` for a copy gate on the
    root over suffixes of up to eight tokens (:attr:`TreeSpec.copy_bias`). A DySpec tree
    whose last child per node is drafted greedily reads ``dyspec-threshold d1 n5 thr0.001
    greedy1`` (:attr:`TreeSpec.greedy_children`)."""
    label = _shape_label(tree)
    if tree.lookup:
        least = f" m{tree.lookup_min}" if tree.lookup_min > 1 else ""
        # Labels key calibration records and A/B rows: two trees that differ only in the
        # suffix length they match must not share one.
        longest = (f" g{tree.lookup_ngram}"
                   if tree.lookup_ngram != TreeSpec().lookup_ngram else "")
        label += f" +lookup{tree.lookup}{least}{longest}"
    return label + (f" +copy{len(tree.copy_bias)}" if tree.copy_bias else "")


def _shape_label(tree: TreeSpec) -> str:
    if tree.kind == "chain":
        return f"chain d{tree.depth}"
    if tree.kind == "static":  # small trees by their paths (ranks from the root), e.g. 0 1 00
        if len(tree.paths) <= 12 and max(max(p) for p in tree.paths) < 10:
            return "static " + " ".join("".join(map(str, p)) for p in tree.paths)
        return f"static n{len(tree.paths)} d{max(map(len, tree.paths))}"
    if tree.kind == "eagle2":
        return f"eagle2 d{tree.depth} k{tree.top_k} n{tree.total_tokens}"
    # Sampled DySpec trees that draft the drafter's last g children greedily (g > 0) differ
    # from their all-sampled twins in what they accept, so they get their own label.
    children = (" top-k" if tree.topk_children else "") + (
        f" greedy{tree.greedy_children}" if tree.greedy_children else "")
    if tree.kind == "dyspec":
        return f"dyspec n{tree.total_tokens}{children}"
    cap = f" f{tree.frontier}" if 0 < tree.frontier < tree.total_tokens else ""
    return f"{tree.kind} d{tree.depth} n{tree.total_tokens}{cap} thr{tree.threshold:g}{children}"
