"""A drafter's measured defaults: ``<drafter>/default_tree.json``.

The fastest lossless tree depends on the drafter's acceptance and on the hardware's target
latency curve, so it is measured (``specjax bench spec --save-default-tree``, Sequoia's
way: calibration MAL / (verify(T) + draft time)) and stored beside the drafter with how it
was measured. The same run's vocabulary head is stored with it when it was not the full
one: on a large vocabulary (Gemma 3's 262k) only a shortlist head makes drafting pay, so
the head is part of the default. ``specjax.generate`` and ``specjax generate`` use both
when given none; a drafter without the file gets :class:`TreeSpec`'s defaults and the
full head.

The file may also hold trees for sampling (``"sampled"``: by the temperature each was
measured at, each with its own ``measured``): at a temperature above 0 a drafted child is
accepted with probability ``min(1, p / q)`` rather than when it is the target's argmax, so
the fastest tree differs, and it moves with the temperature (Sequoia calibrates one per
temperature; SmolLM2 at 0.3: the greedy tree 1.17x the speed of the tree measured at 1).
Sampling at temperature t drafts the tree measured nearest t (:func:`sampled_tree_at`)
where there is one, else the greedy tree; the head is the file's for all of them. A file
written before the eightieth session holds one entry, ``{"tree", "measured"}``, measured
at temperature 1, and reads as that.

It may hold batch defaults too (``"batch"``, written by ``specjax bench batch
--save-default-tree``): a verify forward over B rows x T nodes turns compute-bound sooner
than one over T, so the tree fastest at batch 1 can lose to vanilla decoding at batch 2.
For each measured batch size B >= 2 the entry is the greedy tree fastest there, or null
where no tree was resolved faster than vanilla decoding (then generate decodes without the
drafter: the output is the same). A batch of n rows takes the entry of the largest
measured size <= n; batch 1 (and fewer rows than any measured size) the greedy tree.
Sampled batch defaults (``"sampled_batch"``: one such table by the temperature each was
measured at, written by ``specjax bench batch --temperature T --save-default-tree``) serve
temperature > 0 where present, the table measured nearest it as for the trees at batch 1:
a lookup chain that pays at greedy batches is accepted less the higher the temperature
(Gemma 3 at 3 rows, temperature 1: chain d1 + lookup 2 1.02x vanilla, chain d1 alone
1.20x; at 2 rows, temperature 0.3: chain d1 + lookup 4 1.61x, chain d1 1.28x); without
them sampling drafts the greedy batch trees. A file written before the eighty-first
session holds one table, ``{"trees", "measured"}``, measured at temperature 1, and reads
as that.

The trees at batch 1 may also be stored by machine class (``"machines"``: by
:func:`machine_class`, e.g. ``"cpu-avx2"``, each with a greedy ``{"tree", "measured"}``
and trees for sampling ``"sampled"`` as above, written by ``specjax bench spec
--save-default-tree --for-this-machine``): the verify forward's cost against its rows is
the hardware's, and a CPU without AVX-512 computes a tile's extra rows at half the vector
width (SmolLM2 on a Zen 3: 8 rows 1.37-1.50 of one row's forward, on a Zen 4 1.18), so
the wider tree that ties on AVX-512 loses there. A machine of a class the file names
drafts that class's greedy tree where it has one, and samples at a temperature with the
class's tree where it has one measured there, the file's otherwise; any other machine
drafts the file's. The head and the batch tables are the file's for all of them.

A stored head names only artifacts inside the drafter's folder (``fr:8192``, never
``fr:8192:/some/path``), so the folder can be copied or shipped whole.
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax

from specjax.checkpoint import write_json_atomic
from specjax.tree.spec import TreeSpec

FILE = "default_tree.json"
FORMAT = "specjax-default-tree"
BatchTrees = tuple[tuple[int, TreeSpec | None], ...]
SampledTrees = tuple[tuple[float, TreeSpec], ...]
SampledBatchTrees = tuple[tuple[float, BatchTrees], ...]
# The entries measured beside the greedy tree, drafting with the head it stores.
_MEASURED_WITH_THE_HEAD = ("sampled", "batch", "sampled_batch", "machines")


class Defaults(NamedTuple):
    """A drafter folder's defaults, from one read of its file (:func:`read_defaults`)."""

    tree: TreeSpec | None  # greedy, batch 1, for the machine read for; None without a file
    vocab: str | None  # the head every tree drafts with; None without a file
    # (temperature > 0 it was measured at, tree) by temperature, batch 1; (): the greedy tree
    sampled_trees: SampledTrees = ()
    # (batch size >= 2, tree or None for vanilla decoding) by size; () where not measured.
    batch_trees: BatchTrees = ()
    # (temperature > 0 it was measured at, such a table) by temperature; (): the greedy one
    sampled_batch_trees: SampledBatchTrees = ()
    # The machine class whose trees (some of ``tree`` and ``sampled_trees``) were read;
    # None: the file names no trees for this machine's class.
    machine: str | None = None


@functools.cache
def machine_class() -> str:
    """The class of machine a greedy default is measured for: jax's backend, and on a CPU the
    vector instructions the kernels are built for (``"cpu-avx512f"``, ``"cpu-avx2"``;
    ``"cpu"`` where they build for neither), e.g. ``"gpu"``."""
    backend = jax.default_backend()
    if backend != "cpu":
        return backend
    from specjax.kernels.cpu_build import cpu_isa  # kernels import jax's FFI; load lazily

    isa = cpu_isa()
    return f"cpu-{isa}" if isa else "cpu"


def check_portable_vocab(spec: str) -> str:
    """``spec`` if it is a head spec that reads only the drafter folder's own artifacts.

    Raises:
      ValueError: it names a file or folder (``fr:N:PATH``, ``dynaspec:ROUTER``,
        ``evospec:NS+ND:GRAPH``), which would not travel with the drafter.
    """
    name, _, arg = spec.partition(":")
    # The part that names a file: after the size for fr/pafr/evospec, all of a dynaspec's.
    where = arg.partition(":")[2] if name in ("fr", "pafr", "evospec") else arg
    if where and not (name == "evospec" and where == "none"):
        raise ValueError(f"the head {spec!r} names an artifact outside the drafter folder; "
                         "a default head must use the folder's own (copy the counts, router "
                         "or graph into the drafter folder and drop the path)")
    return spec


def _read(folder: str | Path) -> dict[str, Any] | None:
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT!r} file")
        d["tree"] = TreeSpec.from_json(d["tree"])
        if "sampled" in d:
            d["sampled"] = _by_temperature("sampled", d["sampled"], "tree", _sampled_entry)
        if "batch" in d:
            d["batch"] = {**d["batch"], "trees": _batch_trees("batch", d["batch"])}
        if "sampled_batch" in d:
            d["sampled_batch"] = _by_temperature("sampled_batch", d["sampled_batch"], "trees",
                                                 lambda e: {**e, "trees": _batch_trees(
                                                     "sampled_batch", e)})
        if "machines" in d:
            d["machines"] = _machine_trees(d["machines"])
        vocab = d.get("vocab", "full")
        if not isinstance(vocab, str):
            raise ValueError(f"vocab must be a head spec string, got {vocab!r}")
        d["vocab"] = check_portable_vocab(vocab)
        return d
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a valid default tree ({e}); delete it to use "
                         "TreeSpec's defaults and the full head, or measure one again with "
                         "`specjax bench spec --save-default-tree`") from None


def _machine_trees(value: Any) -> dict[str, dict[str, Any]]:
    """The ``"machines"`` entry, ``{class: {"tree", "measured", "sampled"}}`` (a greedy
    tree, trees for sampling, or both), with parsed trees."""
    if not isinstance(value, dict) or not value:
        raise ValueError("machines must be an object with trees by machine class")
    out = {}
    for name, entry in value.items():
        if not isinstance(entry, dict) or not {"tree", "sampled"} & set(entry):
            raise ValueError(f"machines[{name!r}] must be an object with a tree or sampled")
        e = dict(entry)
        if "tree" in e:
            e["tree"] = TreeSpec.from_json(e["tree"])
        if "sampled" in e:
            e["sampled"] = _by_temperature(f"machines[{name!r}].sampled", e["sampled"],
                                           "tree", _sampled_entry)
        out[str(name)] = e
    return out


def _sampled_entry(e: dict[str, Any]) -> dict[str, Any]:
    """A tree for sampling's entry, ``{"tree", "measured"}``, with its tree parsed."""
    return {**e, "tree": TreeSpec.from_json(e["tree"])}


def _batch_trees(entry: str, batch: Any) -> BatchTrees:
    """A ``"batch"`` or ``"sampled_batch"`` entry's trees as (size, tree or None) pairs,
    by size."""
    if not isinstance(batch, dict) or not isinstance(batch.get("trees"), dict):
        raise ValueError(f"{entry} must be an object with trees by batch size")
    out = []
    for size, tree in batch["trees"].items():
        if not str(size).isdigit() or int(size) < 2:
            raise ValueError(f"batch sizes are integers >= 2, got {size!r}")
        out.append((int(size), None if tree is None else TreeSpec.from_json(tree)))
    return tuple(sorted(out, key=lambda x: x[0]))


def _by_temperature(name: str, value: Any, legacy: str,
                    parse: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[float, Any]:
    """A ``"sampled"`` or ``"sampled_batch"`` entry, ``{"temperatures": {t: entry}}``, as
    {temperature: ``parse(entry)``} by temperature; the one-entry form of older files
    (holding the key ``legacy``) as measured at temperature 1 (every such file's was)."""
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object with trees by temperature")
    by_t = {"1": value} if legacy in value else value.get("temperatures")
    if not isinstance(by_t, dict) or not by_t:
        raise ValueError(f"{name} must be an object with trees by temperature")
    out = {}
    for t, entry in by_t.items():
        try:
            temperature = float(t)
        except ValueError:
            raise ValueError(f"{name} temperatures are numbers > 0, got {t!r}") from None
        if not 0 < temperature < math.inf or not isinstance(entry, dict):
            raise ValueError(f"{name} temperatures are numbers > 0 with trees, got {t!r}")
        out[temperature] = parse(entry)
    return dict(sorted(out.items()))


def nearest_temperature(entries: Sequence[tuple[float, Any]],
                        temperature: float) -> float | None:
    """The measured temperature in ``entries`` ((temperature, tree or table) pairs) nearest
    ``temperature`` (the higher of two as near), or None where ``entries`` is empty."""
    return min((t for t, _ in reversed(entries)), key=lambda t: abs(t - temperature),
               default=None)


def sampled_tree_at(trees: SampledTrees, temperature: float) -> TreeSpec | None:
    """The tree measured at the temperature nearest ``temperature``
    (:func:`nearest_temperature`), or None where ``trees`` is empty. Acceptance moves
    smoothly with the temperature, so the nearest measurement stands in for the rest:
    SmolLM2 sampling at 0.3 drafts its greedy tree faster (1.17x the speed of the tree
    chosen at 1, on calibration prompts), at 0.7 the two tie."""
    t = nearest_temperature(trees, temperature)
    return None if t is None else dict(trees)[t]


def sampled_batch_at(tables: SampledBatchTrees, temperature: float) -> BatchTrees:
    """The batch table measured at the temperature nearest ``temperature``
    (:func:`nearest_temperature`), or () where ``tables`` is empty."""
    t = nearest_temperature(tables, temperature)
    return () if t is None else dict(tables)[t]


def read_batch_trees(folder: str | Path, *, temperature: float = 0.0) -> BatchTrees:
    """``folder``'s batch defaults for greedy decoding, or at ``temperature`` > 0 the
    sampled ones measured nearest it (:func:`sampled_batch_at`): (batch size, tree, or None
    where speculation lost to vanilla decoding) pairs by size; () where none were measured
    (see :func:`read_defaults`, which raises the same errors)."""
    d = read_defaults(folder)
    return (d.batch_trees if temperature == 0
            else sampled_batch_at(d.sampled_batch_trees, temperature))


def read_defaults(folder: str | Path, machine: str | None = None) -> Defaults:
    """``folder``'s defaults from one read of its file, for a machine of class ``machine``
    (default: this one's, :func:`machine_class`): all None and () without a file; the head
    "full" when the file names none; an entry the file lacks None or (); the greedy tree and
    each temperature's tree for sampling the class's own where the file stores one, else
    the main ones.

    Raises:
      ValueError: the file exists but is not a valid default (names the file and how to
        fix it).
    """
    d = _read(folder)
    if d is None:
        return Defaults(None, None)
    machine = machine or machine_class()
    own = d.get("machines", {}).get(machine, {})
    sampled = dict(sorted((d.get("sampled", {}) | own.get("sampled", {})).items()))
    return Defaults(own.get("tree", d["tree"]), d["vocab"],
                    tuple((t, e["tree"]) for t, e in sampled.items()),
                    d["batch"]["trees"] if "batch" in d else (),
                    tuple((t, e["trees"]) for t, e in d.get("sampled_batch", {}).items()),
                    machine if own else None)


def read_default_tree(folder: str | Path, *, temperature: float = 0.0,
                      machine: str | None = None) -> TreeSpec | None:
    """The greedy tree stored in ``folder`` for a machine of class ``machine`` (default:
    this one's), or at ``temperature`` > 0 the tree for sampling measured nearest it
    (:func:`sampled_tree_at`; None where the file has none; see :func:`read_defaults`,
    which raises the same errors)."""
    d = read_defaults(folder, machine)
    return d.tree if temperature == 0 else sampled_tree_at(d.sampled_trees, temperature)


def stored_greedy_trees(folder: str | Path) -> tuple[TreeSpec, ...]:
    """Every greedy batch-1 tree ``folder`` stores, each once: the main one, then each
    machine class's (what a re-measurement on any class compares); () without a file."""
    d = _read(folder)
    if d is None:
        return ()
    return tuple(dict.fromkeys([d["tree"], *(e["tree"] for e in
                                             d.get("machines", {}).values() if "tree" in e)]))


def read_default_vocab(folder: str | Path) -> str | None:
    """The head spec stored in ``folder`` (see :func:`read_defaults`)."""
    return read_defaults(folder).vocab


def write_default_tree(folder: str | Path, tree: TreeSpec, measured: dict[str, Any],
                       vocab: str = "full") -> Path:
    """Store ``tree`` and the head ``vocab`` as ``folder``'s defaults, with ``measured``
    (how they were chosen). The trees for sampling, the batch defaults and the machine
    classes' trees already in a valid file are kept, each measured on its own, where they
    drafted with the same head; with
    another they are dropped (with a warning that says how to measure them again): they
    were measured with the old head, which every tree in the file shares. Raises
    ValueError for a head that names an outside path."""
    vocab = check_portable_vocab(vocab)
    try:
        old = _read(folder) or {}
    except ValueError:  # an invalid file is replaced whole
        old = {}
    if old and old["vocab"] != vocab and (stale := [k for k in _MEASURED_WITH_THE_HEAD
                                                    if k in old]):
        warnings.warn(f"{Path(folder) / FILE}: the head changed from {old['vocab']!r} to "
                      f"{vocab!r}, so its entries {stale} (measured with the old head) were "
                      "dropped; measure them again with this head (`specjax bench spec "
                      "--temperature T --add-tree ... --save-default-tree`, `specjax bench "
                      "batch --calibration 24 [--temperature T] --save-default-tree`, on "
                      "another machine class `specjax bench spec --save-default-tree "
                      "--for-this-machine`)",
                      stacklevel=2)
        old = {k: v for k, v in old.items() if k not in stale}
    return _write(folder, old | {"tree": tree, "vocab": vocab, "measured": measured})


def write_sampled_default_tree(folder: str | Path, tree: TreeSpec, measured: dict[str, Any],
                               *, temperature: float) -> Path:
    """Store ``tree`` as ``folder``'s tree for sampling at ``temperature`` (where it was
    measured), with ``measured``, beside the greedy default, the head and the trees measured
    at other temperatures already there (the head is shared, so it must have been measured).

    Raises:
      ValueError: a temperature not > 0; the folder has no default tree yet, or an invalid
        one.
    """
    if not 0 < temperature < math.inf:
        raise ValueError(f"a tree for sampling is measured at a finite temperature > 0, got "
                         f"{temperature!r}; the greedy tree is write_default_tree's")
    old = _read_measured(folder, "every tree uses")
    return _write(folder, old | {"sampled": _with_temperature(
        old.get("sampled", {}), temperature, {"tree": tree, "measured": measured})})


def write_batch_trees(folder: str | Path, trees: dict[int, TreeSpec | None],
                      measured: dict[str, Any], *, temperature: float = 0.0) -> Path:
    """Store ``trees`` (batch size >= 2 -> the tree fastest there, or None where no tree
    beat vanilla decoding) as ``folder``'s batch defaults for greedy decoding, or with
    ``temperature`` > 0 (where they were measured) those for sampling at it, with
    ``measured``, beside the trees, head and tables at other temperatures already there
    (the head is shared, so it must have been measured).

    A batch of n rows drafts the entry of the largest stored size <= n (the batch-1 tree
    below the smallest; nothing above the largest, where no tree was measured: see
    :meth:`specjax.loaded.Drafter.speculates_at`), so an unmeasured size between 2 and the
    largest stored one would draft a tree measured at another size: the sizes must run 2,
    3, ... without a gap up to any entry after which a tree is still drafted (a gap after a
    vanilla entry decodes without the drafter, measured or not).

    Raises:
      ValueError: the folder has no default tree yet, or an invalid one; a size below 2; an
        unmeasured size that would draft a tree measured elsewhere; a temperature below 0,
        infinite or NaN.
    """
    if not 0 <= temperature < math.inf:
        raise ValueError(f"batch trees are measured at a finite temperature >= 0 (0: "
                         f"greedy), got {temperature!r}")
    old = _read_measured(folder, "every tree uses")
    if any(b < 2 for b in trees):
        raise ValueError(f"batch sizes are integers >= 2, got {sorted(trees)}")
    if gaps := unmeasured_drafting_sizes(trees):
        raise ValueError(
            f"batch sizes {gaps} were not measured but would draft the tree of a smaller "
            f"size (measured: {sorted(trees)}); measure every size from 2 up to the first "
            "where vanilla decoding wins (`specjax bench batch --batch-sizes "
            f"{','.join(map(str, sorted(set(trees) | set(gaps))))} --save-default-tree`)")
    table = {"trees": tuple(sorted(trees.items())), "measured": measured}
    if temperature == 0:
        return _write(folder, old | {"batch": table})
    return _write(folder, old | {"sampled_batch": _with_temperature(
        old.get("sampled_batch", {}), temperature, table)})


def write_machine_default_tree(folder: str | Path, tree: TreeSpec, measured: dict[str, Any],
                               *, machine: str, temperature: float = 0.0) -> Path:
    """Store ``tree`` as the greedy default (``temperature`` 0) of machines of class
    ``machine`` (where it was measured, :func:`machine_class`), or as their tree for
    sampling at ``temperature``, with ``measured``, beside the file's main trees (which
    machines of other classes keep drafting), its head and the other entries.

    Raises:
      ValueError: an empty class; a temperature not >= 0; the folder has no default tree
        yet, or an invalid one.
    """
    if not isinstance(machine, str) or not machine:
        raise ValueError(f"a machine class is a name such as 'cpu-avx2', got {machine!r}")
    if not 0 <= temperature < math.inf:
        raise ValueError(f"a tree is measured at a finite temperature >= 0, got "
                         f"{temperature!r}")
    old = _read_measured(folder, "every tree uses")
    own = dict(old.get("machines", {}).get(machine, {}))
    if temperature == 0:
        own |= {"tree": tree, "measured": measured}
    else:
        own["sampled"] = _with_temperature(own.get("sampled", {}), temperature,
                                           {"tree": tree, "measured": measured})
    return _write(folder, old | {"machines": {**old.get("machines", {}), machine: own}})


def _with_temperature(entries: dict[float, Any], temperature: float,
                      entry: Any) -> dict[float, Any]:
    """``entries`` (by temperature, as :func:`_read` returns them) with ``entry`` at
    ``temperature``, keyed as the file spells it so that a rewrite replaces it."""
    t = float(_temperature_key(temperature))
    return dict(sorted((entries | {t: entry}).items()))


def _read_measured(folder: str | Path, shared: str) -> dict[str, Any]:
    """``folder``'s valid file as :func:`_read` returns it, for an entry written beside the
    greedy default and its head (``shared`` ends the error's sentence: what the head
    serves)."""
    old = _read(folder)
    if old is None:
        raise ValueError(f"{Path(folder) / FILE} does not exist; measure the greedy default "
                         "first (`specjax bench spec --save-default-tree`), which also "
                         f"stores the head {shared}")
    return old


def unmeasured_drafting_sizes(trees: Mapping[int, object]) -> list[int]:
    """The sizes in [2, max(trees)] missing from ``trees`` whose inherited entry (the largest
    measured size below them, the batch-1 tree below the smallest) drafts a tree; an entry
    of None is vanilla decoding, any other value a tree."""
    gaps, inherited = [], True  # below the smallest size: the batch-1 tree, which drafts
    for n in range(2, max(trees, default=1) + 1):
        if n in trees:
            inherited = trees[n] is not None
        elif inherited:
            gaps.append(n)
    return gaps


def _temperature_key(temperature: float) -> str:
    """How the file spells a sampled tree's temperature: six significant digits, "1" for
    1.0 (the key older files' one tree reads as)."""
    return f"{temperature:g}"


def _write(folder: str | Path, d: dict[str, Any]) -> Path:
    """The file, atomically, from ``d`` as :func:`_read` returns it (the greedy tree, head
    and ``measured``; ``sampled`` and ``sampled_batch`` (by temperature), ``batch`` and
    ``machines`` (by class) where present)."""
    data = {"format": FORMAT, "tree": d["tree"].to_json(), "vocab": d["vocab"],
            "measured": d.get("measured", {})}
    if "sampled" in d:
        data["sampled"] = _sampled_json(d["sampled"])
    if "batch" in d:
        data["batch"] = _batch_json(d["batch"])
    if "sampled_batch" in d:
        data["sampled_batch"] = {"temperatures": {
            _temperature_key(t): _batch_json(e) for t, e in d["sampled_batch"].items()}}
    if "machines" in d:
        data["machines"] = {m: _machine_json(e) for m, e in sorted(d["machines"].items())}
    path = Path(folder) / FILE
    write_json_atomic(path, data)
    return path


def _sampled_json(entries: dict[float, Any]) -> dict[str, Any]:
    """Trees for sampling by temperature (as :func:`_read` returns them) as the file holds
    them."""
    return {"temperatures": {_temperature_key(t): {**e, "tree": e["tree"].to_json()}
                             for t, e in entries.items()}}


def _machine_json(entry: dict[str, Any]) -> dict[str, Any]:
    """A machine class's entry (as :func:`_read` returns it) as the file holds it."""
    out = dict(entry)
    if "tree" in out:
        out["tree"] = out["tree"].to_json()
    if "sampled" in out:
        out["sampled"] = _sampled_json(out["sampled"])
    return out


def _batch_json(table: dict[str, Any]) -> dict[str, Any]:
    """A batch table (``trees`` as (size, tree or None) pairs) as the file holds it."""
    return {**table, "trees": {str(b): None if t is None else t.to_json()
                               for b, t in table["trees"]}}
