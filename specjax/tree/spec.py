"""Which draft tree a run builds (:class:`TreeSpec`), and the registry of tree builders.

A tree builder is one module under ``specjax/tree/`` that implements :class:`TreeBuilder`
and registers itself under a kind name; ``specjax/tree/__init__.py`` imports it. Nothing
else changes: the speculative loop only calls the spec's ``build`` and reads its sizes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, ClassVar, Protocol

from jax import Array

from specjax.tree.base import Carry, DraftTree, ExpandFn


class TreeBuilder(Protocol):
    """One kind of draft tree. Every size is static: it fixes the compiled program."""

    # Whether sampling mode draws children from q (so verification may use q): trees whose
    # shape is fixed in advance draw exact samples without replacement (SpecInfer/Sequoia
    # verification applies); trees that keep nodes by drafted value take them top-k.
    samples_children: ClassVar[bool]
    # Whether ``build`` may skip drafter calls at run time (under ``lax.cond``): such a
    # builder needs an ``expand`` without trace-time side effects after the root's call.
    skips_expansions: ClassVar[bool]

    def prepare(self, spec: TreeSpec) -> dict[str, Any]:
        """Validate ``spec`` (ValueError naming the field) and return canonical field values."""
        ...

    def num_nodes(self, spec: TreeSpec) -> int:
        """T, the tree's nodes including the root: the target verifies all of them."""
        ...

    def max_depth(self, spec: TreeSpec) -> int:
        """The deepest draft: the longest path verification can accept."""
        ...

    def workspace(self, spec: TreeSpec) -> int:
        """Drafter cache rows one build writes past the committed prefix."""
        ...

    def build(self, spec: TreeSpec, expand: ExpandFn, carry: Carry, root: Array,
              key: Array | None, temperature: float | Array,
              vocab_size: int) -> tuple[DraftTree, Carry]:
        """Draft one tree per row from ``root`` [B] with ``expand`` (see :class:`ExpandFn`)."""
        ...


BUILDERS: dict[str, TreeBuilder] = {}


def register(kind: str, builder: TreeBuilder) -> None:
    """Make ``TreeSpec(kind=...)`` build with ``builder``."""
    if kind in BUILDERS:
        raise ValueError(f"a tree builder is already registered as {kind!r}")
    BUILDERS[kind] = builder


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """Which draft tree to build; static (it fixes every shape).

    kind: a registered builder (``chain``, ``static``, ``eagle2``, ``dyspec``,
      ``dyspec-threshold``).
    depth: chain length, EAGLE-2 expansions (= the deepest draft), or DySpec threshold
      trees' most layers; ``dyspec`` trees take none (left at its default).
    top_k: EAGLE-2 beam width and children per expanded node.
    total_tokens: EAGLE-2 draft nodes kept (root excluded); DySpec's node budget.
    paths: static trees' child-rank paths.
    threshold: DySpec threshold trees' least slot value worth drafting.
    frontier: DySpec threshold trees' most nodes expanded per layer, the highest-valued
      (0: every node of the layer, up to ``total_tokens``); the rest stay leaves.
    topk_children: DySpec trees only; when sampling, take children in top-k order of q and
      key slots by the chance the drafted node is *accepted* (as at temperature 0), and
      verify with the point-mass rule (EAGLE-2's), instead of drawing children without
      replacement and verifying by multi-draft rejection sampling. Both are exact; with a
      weak drafter and a peaked target the top-k children are accepted more often.
    greedy_children: DySpec trees only, when sampling: the last this many children of each
      expanded node are q's top ones, drafted deterministically and verified after their
      sampled siblings by the point-mass rule; the others are sampled without replacement
      from q without them (Hu et al., 2025's greedy multi-draft). Exact; 0 samples them
      all. A rejected sampled child leaves the target's mass on q's top tokens untouched,
      so they are accepted more often tried last than drawn among the samples.
    lookup: any kind; tokens of a chain copied from the committed text
      (:mod:`specjax.tree.lookup`) grafted onto the drafter's tree every step, 0 = none.
      They add ``lookup`` nodes to T and may reach depth ``lookup``.
    lookup_ngram: the longest suffix of the committed text the lookup matches.
    lookup_min: the shortest suffix match that grafts the chain. A step where no row
      matched that many tokens verifies the tree without the chain's nodes (a smaller
      verify forward); 1 grafts whenever the last token occurred before.
    copy_bias: any kind; logit bonuses for the root's lookup token, a copy gate on the
      drafter's first draft (:func:`specjax.tree.lookup.copy_bias`): entry m - 1 is added
      to the drafter's logit of the token that followed the latest occurrence of the
      longest suffix of the committed text, when that suffix is m tokens long (the lookup
      tries ``len(copy_bias)`` tokens). A long match makes a copy likely, which a small
      drafter cannot tell; the bonus lets it rank the copy first. () = no gate. A
      shortlist head that lacks the token gets it in place of its lowest candidate
      (:func:`specjax.tree.lookup.gate_root`); q is the gated softmax when sampling, so
      verification stays exact.
    """

    kind: str = "eagle2"
    depth: int = 4
    top_k: int = 4
    total_tokens: int = 12
    paths: tuple[tuple[int, ...], ...] = ()
    threshold: float = 0.0
    frontier: int = 0
    topk_children: bool = False
    greedy_children: int = 0
    lookup: int = 0
    lookup_ngram: int = 3
    lookup_min: int = 1
    copy_bias: tuple[float, ...] = ()

    def __post_init__(self):
        if self.kind not in BUILDERS:
            raise ValueError(f"tree kind must be one of {', '.join(sorted(BUILDERS))}, got "
                             f"{self.kind!r}")
        g = self.greedy_children
        if isinstance(g, bool) or not isinstance(g, int) or g < 0:
            raise ValueError(f"tree greedy_children must be an int >= 0, got {g!r}")
        if g and (not self.kind.startswith("dyspec") or self.topk_children):
            raise ValueError(f"only dyspec trees that sample their children take "
                             f"greedy_children; a {self.kind} tree"
                             f"{' with topk_children' if self.topk_children else ''} got "
                             f"greedy_children={g}")
        if g and g >= self.total_tokens:
            raise ValueError(f"tree greedy_children ({g}) must be below total_tokens "
                             f"({self.total_tokens}): at least one child is sampled")
        for name in ("depth", "top_k", "total_tokens"):  # before any size is derived from them
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"tree {name} must be an int >= 1, got {v!r}")
        if isinstance(self.frontier, bool) or not isinstance(self.frontier, int) or (
                self.frontier < 0):
            raise ValueError(f"tree frontier must be an int >= 0, got {self.frontier!r}")
        if self.frontier and self.kind != "dyspec-threshold":
            raise ValueError(f"only dyspec-threshold trees take a frontier cap; a {self.kind} "
                             f"tree got frontier={self.frontier}")
        for name, least in (("lookup", 0), ("lookup_ngram", 1), ("lookup_min", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"tree {name} must be an int >= {least}, got {v!r}")
        bias = self.copy_bias
        if not isinstance(bias, tuple) or any(
                isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b)
                or b < 0 for b in bias):
            raise ValueError(f"tree copy_bias must be a tuple of finite numbers >= 0 (a logit "
                             f"bonus per suffix length), got {bias!r}")
        object.__setattr__(self, "copy_bias", tuple(float(b) for b in bias))
        if self.lookup_min > self.lookup_ngram:
            raise ValueError(f"tree lookup_min ({self.lookup_min}) cannot exceed lookup_ngram "
                             f"({self.lookup_ngram}), the longest match the lookup tries")
        if self.threshold and self.kind != "dyspec-threshold":
            raise ValueError(f"only dyspec-threshold trees take a threshold; a {self.kind} "
                             f"tree got threshold={self.threshold}")
        if not isinstance(self.topk_children, bool):
            raise ValueError(f"tree topk_children must be a bool, got {self.topk_children!r}")
        if self.topk_children and not self.kind.startswith("dyspec"):
            raise ValueError(f"only dyspec trees choose how they draft children; a {self.kind} "
                             f"tree got topk_children=True (eagle2 always drafts top-k)")
        for name, value in self.builder.prepare(self).items():
            object.__setattr__(self, name, value)

    @property
    def builder(self) -> TreeBuilder:
        return BUILDERS[self.kind]

    @property
    def num_nodes(self) -> int:
        """T, the tree's nodes including the root (and the lookup chain's)."""
        return self.builder.num_nodes(self) + self.lookup

    @property
    def max_depth(self) -> int:
        """The deepest node: the longest path verification can accept."""
        return max(self.builder.max_depth(self), self.lookup)

    @property
    def reads_history(self) -> bool:
        """Whether a draft step reads the committed text (a lookup chain or a copy gate)."""
        return bool(self.lookup or self.copy_bias)

    @property
    def workspace(self) -> int:
        """Drafter rows one tree build writes past the prefix."""
        return self.builder.workspace(self)

    @property
    def samples_children(self) -> bool:
        """Whether sampling mode draws children from q (see :class:`TreeBuilder`)."""
        return self.builder.samples_children and not self.topk_children

    @property
    def skips_expansions(self) -> bool:
        """Whether a build may skip drafter calls at run time (see :class:`TreeBuilder`)."""
        return self.builder.skips_expansions

    def build(self, expand: ExpandFn, carry: Carry, root: Array, key: Array | None,
              temperature: float | Array, vocab_size: int) -> tuple[DraftTree, Carry]:
        return self.builder.build(self, expand, carry, root, key, temperature, vocab_size)

    def to_json(self) -> dict[str, Any]:
        """The fields that shape this kind of tree, plus its node count T (root included)."""
        d = dataclasses.asdict(self)
        d["num_nodes"] = self.num_nodes
        if self.kind != "eagle2":
            d.pop("top_k")
        if self.kind in ("chain", "static"):  # DySpec's budget is total_tokens too
            d.pop("total_tokens")
        if self.kind != "static":
            d.pop("paths")
        if self.kind != "dyspec-threshold":
            d.pop("frontier")
        if not self.kind.startswith("dyspec"):
            d.pop("topk_children")
        if not self.greedy_children:  # trees saved before greedy children read unchanged
            d.pop("greedy_children")
        if not self.lookup:  # trees saved before lookup chains read and write unchanged
            for name in ("lookup", "lookup_ngram", "lookup_min"):
                d.pop(name)
        if self.copy_bias:
            d["copy_bias"] = list(self.copy_bias)
        else:  # trees saved before the copy gate read and write unchanged
            d.pop("copy_bias")
        return d

    @classmethod
    def from_json(cls, d: Any) -> TreeSpec:
        """A tree from its fields as JSON (``num_nodes``, if present, must agree).

        Raises:
          ValueError: not an object, an unknown field, or a field the builder refuses.
        """
        if not isinstance(d, dict):
            raise ValueError(f"a tree must be a JSON object, got {type(d).__name__}")
        d = dict(d)
        nodes = d.pop("num_nodes", None)
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(d) - known):
            raise ValueError(f"unknown tree field(s) {unknown}; known: {sorted(known)}")
        if "paths" in d:
            d["paths"] = tuple(tuple(p) for p in d["paths"])
        if isinstance(d.get("copy_bias"), list):
            d["copy_bias"] = tuple(d["copy_bias"])
        tree = cls(**d)
        if nodes is not None and nodes != tree.num_nodes:
            raise ValueError(f"the tree says num_nodes {nodes} but its fields give "
                             f"{tree.num_nodes}")
        return tree

    @classmethod
    def from_json_text(cls, text: str, flag: str = "--tree-json") -> TreeSpec:
        """:meth:`from_json` of a command-line value.

        Raises:
          ValueError: naming ``flag``, when ``text`` is not JSON or not a valid tree.
        """
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not JSON ({e}): {text!r}") from None
        try:
            return cls.from_json(fields)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{flag}: {e}") from None
