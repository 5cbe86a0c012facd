"""A drafter's measured default tree: TreeSpec's JSON form, ``default_tree.json``, and the
API and CLI falling back to it when no tree is given."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import warnings

import numpy as np
import pytest
from flax import nnx

import specjax
from specjax.bench.spec_cli import save_default_tree
from specjax.commands.generate import _add_tree, _tree
from specjax.drafter import DrafterConfig, EagleDrafter, save_drafter
from specjax.speculative import TreeSpec
from specjax.tree.default import (
    FILE,
    machine_class,
    read_batch_trees,
    read_default_tree,
    read_default_vocab,
    read_defaults,
    stored_greedy_trees,
    unmeasured_drafting_sizes,
    write_batch_trees,
    write_default_tree,
    write_machine_default_tree,
    write_sampled_default_tree,
)

TREES = [TreeSpec(), TreeSpec("chain", depth=2), TreeSpec("dyspec", total_tokens=6),
         TreeSpec("dyspec-threshold", depth=3, total_tokens=6, threshold=0.3),
         TreeSpec("static", paths=((0,), (1,), (0, 0)))]


@pytest.mark.parametrize("tree", TREES, ids=lambda t: t.kind)
def test_tree_json_round_trip(tree):
    d = json.loads(json.dumps(tree.to_json()))
    assert d["num_nodes"] == tree.num_nodes
    assert TreeSpec.from_json(d) == tree


def test_tree_json_refuses_what_it_cannot_build():
    with pytest.raises(ValueError, match="unknown tree field"):
        TreeSpec.from_json({"kind": "chain", "depth": 2, "width": 3})
    with pytest.raises(ValueError, match="num_nodes 5 but its fields give 3"):
        TreeSpec.from_json({"kind": "chain", "depth": 2, "num_nodes": 5})
    with pytest.raises(ValueError, match="tree kind must be one of"):
        TreeSpec.from_json({"kind": "bush"})
    with pytest.raises(ValueError, match="JSON object"):
        TreeSpec.from_json([1, 2])


def test_default_tree_file(tmp_path):
    assert read_default_tree(tmp_path) is None
    write_default_tree(tmp_path, TreeSpec("chain", depth=2), {"chosen": "chain d2"})
    assert read_default_tree(tmp_path) == TreeSpec("chain", depth=2)
    (tmp_path / FILE).write_text('{"format": "specjax-default-tree", "tree": {"kind": 3}}')
    with pytest.raises(ValueError, match=f"{FILE} is not a valid default tree.*delete it"):
        read_default_tree(tmp_path)
    (tmp_path / FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not a valid default tree"):
        read_default_tree(tmp_path)


def test_a_tree_for_sampling_sits_beside_the_greedy_one(tmp_path):
    chain, wide = TreeSpec("chain", depth=1, lookup=8), TreeSpec(
        "dyspec-threshold", depth=1, total_tokens=2, threshold=0.001, lookup=8)
    with pytest.raises(ValueError, match="does not exist; measure the greedy default first"):
        write_sampled_default_tree(tmp_path, wide, {}, temperature=1.0)
    write_default_tree(tmp_path, chain, {"chosen": "chain"}, vocab="fr:8192")
    assert read_default_tree(tmp_path, temperature=1.0) is None
    write_sampled_default_tree(tmp_path, wide, {"how": "t=1"}, temperature=1.0)
    assert read_default_tree(tmp_path, temperature=1.0) == wide
    assert read_default_tree(tmp_path) == chain and read_default_vocab(tmp_path) == "fr:8192"
    # Measuring the greedy default again (same head) keeps the sampled one, measured on
    # its own.
    write_default_tree(tmp_path, TreeSpec("chain", depth=2), {}, vocab="fr:8192")
    assert read_default_tree(tmp_path, temperature=1.0) == wide
    assert json.loads((tmp_path / FILE).read_text())["sampled"]["temperatures"]["1"][
        "measured"] == {"how": "t=1"}
    text = json.loads((tmp_path / FILE).read_text())
    (tmp_path / FILE).write_text(json.dumps({**text, "sampled": {"tree": {"kind": "bush"}}}))
    with pytest.raises(ValueError, match="not a valid default tree"):
        read_default_tree(tmp_path)
    # An invalid file is replaced whole by a new greedy measurement.
    write_default_tree(tmp_path, chain, {})
    assert read_default_tree(tmp_path) == chain
    assert read_default_tree(tmp_path, temperature=1.0) is None


def test_trees_for_sampling_are_kept_by_temperature(tmp_path):
    """Each temperature keeps its own measured tree; sampling at t drafts the one measured
    nearest t (the higher temperature's where two are as near). A file from before the table
    (one tree) reads as measured at 1."""
    chain, low, high = (TreeSpec("chain", depth=1, lookup=8), TreeSpec("chain", depth=3),
                        TreeSpec("dyspec-threshold", depth=1, total_tokens=4, threshold=0.001))
    write_default_tree(tmp_path, chain, {}, vocab="fr:8192")
    write_sampled_default_tree(tmp_path, high, {"how": "t=1"}, temperature=1.0)
    write_sampled_default_tree(tmp_path, low, {"how": "t=0.3"}, temperature=0.3)
    assert read_defaults(tmp_path).sampled_trees == ((0.3, low), (1.0, high))
    nearest = {t: read_default_tree(tmp_path, temperature=t)
               for t in (0.05, 0.3, 0.6, 0.65, 0.7, 1.0, 2.0)}
    assert nearest == {0.05: low, 0.3: low, 0.6: low, 0.65: high, 0.7: high, 1.0: high,
                       2.0: high}
    assert read_default_tree(tmp_path) == chain  # temperature 0: the greedy tree
    # Re-measuring one temperature replaces only its entry.
    write_sampled_default_tree(tmp_path, chain, {"how": "t=1 again"}, temperature=1)
    assert read_defaults(tmp_path).sampled_trees == ((0.3, low), (1.0, chain))
    text = json.loads((tmp_path / FILE).read_text())
    assert text["sampled"]["temperatures"]["0.3"]["measured"] == {"how": "t=0.3"}
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite temperature > 0"):
            write_sampled_default_tree(tmp_path, low, {}, temperature=bad)
    # A temperature the file spells shorter (6 significant digits) is replaced as spelled.
    write_sampled_default_tree(tmp_path, high, {}, temperature=0.30000001)
    assert read_defaults(tmp_path).sampled_trees == ((0.3, high), (1.0, chain))
    write_sampled_default_tree(tmp_path, low, {"how": "t=0.3"}, temperature=0.3)
    # The one-tree entry older files hold is the tree measured at temperature 1.
    old = {**text, "sampled": {"tree": high.to_json(), "measured": {"how": "s68"}}}
    (tmp_path / FILE).write_text(json.dumps(old))
    assert read_defaults(tmp_path).sampled_trees == ((1.0, high),)
    write_sampled_default_tree(tmp_path, low, {}, temperature=0.3)  # keeps it, new format
    assert read_defaults(tmp_path).sampled_trees == ((0.3, low), (1.0, high))
    for bad in ({"temperatures": {"hot": high.to_json()}}, {"temperatures": {}},
                {"temperatures": {"0": {"tree": high.to_json()}}},
                {"temperatures": {"inf": {"tree": high.to_json()}}},
                {"temperatures": {"0.5": {"measured": {}}}}, [high.to_json()]):
        (tmp_path / FILE).write_text(json.dumps({**text, "sampled": bad}))
        with pytest.raises(ValueError, match="not a valid default tree"):
            read_defaults(tmp_path)


def test_default_head_is_stored_only_when_it_travels_with_the_folder(tmp_path):
    assert read_default_vocab(tmp_path) is None
    write_default_tree(tmp_path, TreeSpec("chain", depth=1), {})
    assert read_default_vocab(tmp_path) == "full"  # a file without a head: the full one
    for spec in ("fr:8192", "pafr:4096", "dynaspec", "dynaspec-f-shared", "evospec:8192+256",
                 "evospec:8192+256:none"):
        write_default_tree(tmp_path, TreeSpec("chain", depth=1), {}, vocab=spec)
        assert read_default_vocab(tmp_path) == spec
    for spec in ("fr:8192:/data/counts.npy", "dynaspec:/routers/r1",
                 "evospec:8192+256:/g.npy"):
        with pytest.raises(ValueError, match="outside the drafter folder"):
            write_default_tree(tmp_path, TreeSpec("chain", depth=1), {}, vocab=spec)
    text = json.loads((tmp_path / FILE).read_text())
    (tmp_path / FILE).write_text(json.dumps({**text, "vocab": "fr:8192:/elsewhere"}))
    with pytest.raises(ValueError, match="not a valid default tree.*outside the drafter"):
        read_default_vocab(tmp_path)


def _cli_tree(*flags: str, drafter=None):
    p = argparse.ArgumentParser()
    _add_tree(p)
    p.add_argument("--temperature", type=float, default=0.0)  # generate's and chat's own
    return _tree(p.parse_args(list(flags)), drafter)


def test_generate_uses_the_drafters_default_tree(tiny_target, tmp_path):
    drafter = EagleDrafter(DrafterConfig(tiny_target.cfg), rngs=nnx.Rngs(0))
    folder = save_drafter(tmp_path / "d", drafter.cfg, drafter.params())
    assert specjax.load_drafter(folder, tiny_target).default_tree is None
    write_default_tree(folder, TreeSpec("chain", depth=2), {})
    d = specjax.load_drafter(folder, tiny_target)
    assert d.default_tree == TreeSpec("chain", depth=2)
    prompt = [[1, 17, 42, 99]]
    stats = specjax.generate(tiny_target, prompt, drafter=d, max_new_tokens=4).stats
    assert stats["tree"]["kind"] == "chain" and stats["tree"]["depth"] == 2
    assert stats["vocab"] == "full" and d.default_vocab == "full"
    given = specjax.generate(tiny_target, prompt, drafter=d, max_new_tokens=4,
                             tree=TreeSpec("eagle2", depth=2, top_k=2, total_tokens=3)).stats
    assert given["tree"]["kind"] == "eagle2"
    # The CLI passes no tree unless a tree flag is given; one flag fills the rest from
    # TreeSpec's defaults.
    assert _cli_tree() is None
    assert _cli_tree("--tree-depth", "3") == TreeSpec(depth=3)
    assert _cli_tree("--tree", "chain") == TreeSpec("chain")
    assert _cli_tree("--tree", "dyspec-threshold", "--tree-threshold", "0.2") == TreeSpec(
        "dyspec-threshold", threshold=0.2)
    assert _cli_tree("--tree", "dyspec-threshold", "--tree-threshold", "0.2",
                     "--tree-frontier", "3") == TreeSpec("dyspec-threshold", threshold=0.2,
                                                         frontier=3)
    assert _cli_tree("--tree", "dyspec", "--tree-topk-children") == TreeSpec(
        "dyspec", topk_children=True)
    assert _cli_tree("--tree", "dyspec", "--tree-tokens", "3", "--tree-greedy-children",
                     "1") == TreeSpec("dyspec", total_tokens=3, greedy_children=1)
    # --tree-lookup alone adds the chain to the drafter's default tree.
    assert _cli_tree("--tree-lookup", "4", drafter=d) == TreeSpec("chain", depth=2, lookup=4)
    # Sampling drafts the tree measured for it, where the folder has one.
    wide = TreeSpec("dyspec-threshold", depth=1, total_tokens=2, threshold=0.001)
    write_sampled_default_tree(folder, wide, {}, temperature=1.0)
    d = specjax.load_drafter(folder, tiny_target)
    assert d.tree_for(0) == TreeSpec("chain", depth=2) and d.tree_for(1.0) == wide
    sampled = specjax.generate(tiny_target, prompt, drafter=d, max_new_tokens=4,
                               temperature=1.0).stats
    assert sampled["tree"]["kind"] == "dyspec-threshold"
    assert specjax.generate(tiny_target, prompt, drafter=d,
                            max_new_tokens=4).stats["tree"]["kind"] == "chain"
    assert _cli_tree("--temperature", "1", "--tree-lookup", "4", drafter=d) == (
        dataclasses.replace(wide, lookup=4))
    # At a temperature measured apart, sampling drafts that temperature's tree.
    write_sampled_default_tree(folder, TreeSpec("chain", depth=3), {}, temperature=0.3)
    d = specjax.load_drafter(folder, tiny_target)
    assert specjax.generate(tiny_target, prompt, drafter=d, max_new_tokens=4,
                            temperature=0.25).stats["tree"]["depth"] == 3
    assert _cli_tree("--temperature", "0.3", "--tree-lookup", "4", drafter=d) == TreeSpec(
        "chain", depth=3, lookup=4)
    with pytest.raises(TypeError, match="temperature"):
        d.tree_for(True)  # the old tree_for(greedy) must not read as temperature 1
    assert _cli_tree("--tree", "chain", "--tree-lookup", "3", "--tree-lookup-min", "2") == (
        TreeSpec("chain", lookup=3, lookup_min=2))
    with pytest.raises(ValueError, match="name the tree"):
        _cli_tree("--tree-topk-children")
    with pytest.raises(ValueError, match="name the tree"):
        _cli_tree("--tree-greedy-children", "1")
    with pytest.raises(ValueError, match="only dyspec trees"):
        _cli_tree("--tree", "chain", "--tree-topk-children")


def test_generate_cli_takes_any_tree_as_json():
    """``--tree-json`` names trees the other flags cannot (a static tree) and the "tree" of
    a default_tree.json; it replaces every other tree flag, and bad text is refused by flag."""
    static = {"kind": "static", "depth": 2, "paths": [[0], [1], [0, 0]], "lookup": 4,
              "lookup_min": 2}
    want = TreeSpec("static", depth=2, paths=((0,), (1,), (0, 0)), lookup=4, lookup_min=2)
    assert _cli_tree("--tree-json", json.dumps(static)) == want
    assert _cli_tree("--tree-json", json.dumps(want.to_json())) == want  # num_nodes agrees
    for extra in (["--tree", "chain"], ["--tree-depth", "3"], ["--tree-lookup", "8"],
                  ["--tree-threshold", "0.2"], ["--tree-greedy-children", "1"]):
        with pytest.raises(ValueError, match=f"--tree-json names the whole tree.*{extra[0]}"):
            _cli_tree("--tree-json", json.dumps(static), *extra)
    with pytest.raises(ValueError, match="--tree-json is not JSON"):
        _cli_tree("--tree-json", "{kind: static}")
    with pytest.raises(ValueError, match="--tree-json: unknown tree field"):
        _cli_tree("--tree-json", json.dumps({"kind": "chain", "width": 3}))
    with pytest.raises(ValueError, match="--tree-json: the tree says num_nodes"):
        _cli_tree("--tree-json", json.dumps({"kind": "chain", "depth": 2, "num_nodes": 9}))


def test_generate_uses_the_drafters_default_head(tiny_target, tmp_path):
    from specjax.vocab.corpus_counts import TokenCounts, save_counts

    drafter = EagleDrafter(DrafterConfig(tiny_target.cfg), rngs=nnx.Rngs(0))
    folder = save_drafter(tmp_path / "d", drafter.cfg, drafter.params())
    v = tiny_target.cfg.vocab_size
    save_counts(folder / "freq_counts.npy", TokenCounts(np.arange(v)[::-1].copy(), None, "t"))
    write_default_tree(folder, TreeSpec("chain", depth=1), {}, vocab="fr:16")
    d = specjax.load_drafter(folder, tiny_target)
    prompt = [[1, 17, 42, 99]]
    greedy = specjax.generate(tiny_target, prompt, max_new_tokens=6).tokens
    res = specjax.generate(tiny_target, prompt, drafter=d, max_new_tokens=6)
    assert res.stats["vocab"].startswith("fr") and res.tokens == greedy
    assert specjax.generate(tiny_target, prompt, drafter=d, max_new_tokens=6,
                            vocab="full").stats["vocab"] == "full"


def test_save_default_tree_only_from_a_lossless_automatic_run(tmp_path):
    grid = [{"label": "chain d2", "est_speedup": 0.9}, {"label": "chain d3", "est_speedup": 0.8}]
    result = {"config": {"tree_mode": "auto", "vocab": "full", "model": "m"},
              "greedy_equality": {"all_match": True}, "tree_label": "chain d2",
              "tree": TreeSpec("chain", depth=2).to_json(),
              "tree_selection": {"chosen": grid[0], "grid": grid},
              "overall": {"speedup": 0.93, "mal": 1.4, "prompts": 24},
              "machine": {"cpu_model": "x", "nproc": 2}}
    path = save_default_tree(result, tmp_path, "r.json")
    saved = json.loads(path.read_text())
    assert saved["measured"]["candidates"] == {"chain d2": 0.9, "chain d3": 0.8}
    assert saved["measured"]["paired"] is None and "end to end" not in saved["measured"]["how"]
    # A paired tie-break's figures go with the choice.
    ab = {"candidates": ["chain d3", "chain d2"], "within": 0.05, "prompts": 24,
          "decided_by": "speed",
          "results": [{"label": "chain d3", "vs_first": {"ratio": 1.0, "ci95": [1.0, 1.0]}},
                      {"label": "chain d2",
                       "vs_first": {"ratio": 1.03, "ci95": [1.01, 1.052]}}]}
    paired = {**result, "tree_selection": {**result["tree_selection"], "ab": ab}}
    saved = json.loads(save_default_tree(paired, tmp_path).read_text())["measured"]
    assert ("2 best within 5% run end to end, paired, on 24 calibration prompts: the fastest "
            "wins, or at a speed tie the higher MAL where resolved (speed)") in saved["how"]
    assert saved["paired"]["chain d2"] == {"speed_vs_first": 1.03, "ci95": [1.01, 1.052]}
    assert read_default_tree(tmp_path) == TreeSpec("chain", depth=2)
    assert read_default_vocab(tmp_path) == "full"
    save_default_tree({**result, "config": {**result["config"], "vocab": "fr:8192"}}, tmp_path)
    assert read_default_vocab(tmp_path) == "fr:8192"
    for change, msg in [({"config": {**result["config"], "tree_mode": "given"}}, "given its tree"),
                        ({"config": {**result["config"], "vocab": "fr:8192:/x.npy"}},
                         "outside the drafter folder"),
                        ({"greedy_equality": {"all_match": False}}, "differed")]:
        with pytest.raises(ValueError, match=msg):
            save_default_tree({**result, **change}, tmp_path)


@pytest.mark.parametrize("trees,gaps", [
    ({2: "t", 3: "t", 4: None}, []),
    ({2: "t", 4: None}, [3]),        # 3 would draft the tree measured at 2
    ({3: "t"}, [2]),                 # 2 would draft the batch-1 tree
    ({2: None, 5: None}, []),        # 3 and 4 decode without the drafter, as 2 does
    ({2: None, 4: "t", 7: None}, [5, 6]),
    ({}, []),
])
def test_unmeasured_sizes_that_would_draft(trees, gaps):
    assert unmeasured_drafting_sizes(trees) == gaps


def test_batch_defaults_sit_beside_the_trees_and_survive_their_remeasurement(tmp_path):
    chain, wide = TreeSpec("chain", depth=1), TreeSpec("dyspec-threshold", depth=1,
                                                       total_tokens=2, threshold=0.001)
    with pytest.raises(ValueError, match="does not exist; measure the greedy default first"):
        write_batch_trees(tmp_path, {2: chain}, {})
    assert read_batch_trees(tmp_path) == ()
    write_default_tree(tmp_path, TreeSpec("chain", depth=2), {}, vocab="fr:8192")
    write_batch_trees(tmp_path, {4: None, 2: chain, 3: chain}, {"how": "bench batch"})
    assert read_batch_trees(tmp_path) == ((2, chain), (3, chain), (4, None))
    # Re-measuring the greedy tree or the tree for sampling keeps them, and they keep those.
    write_sampled_default_tree(tmp_path, wide, {}, temperature=1.0)
    write_default_tree(tmp_path, TreeSpec("chain", depth=3), {}, vocab="fr:8192")
    assert read_batch_trees(tmp_path) == ((2, chain), (3, chain), (4, None))
    assert read_default_tree(tmp_path, temperature=1.0) == wide
    assert json.loads((tmp_path / FILE).read_text())["batch"]["measured"] == {
        "how": "bench batch"}
    with pytest.raises(ValueError, match="batch sizes are integers >= 2"):
        write_batch_trees(tmp_path, {1: chain}, {})
    with pytest.raises(ValueError, match=r"sizes \[3\] were not measured.*--batch-sizes 2,3,4"):
        write_batch_trees(tmp_path, {2: chain, 4: None}, {})
    assert read_batch_trees(tmp_path) == ((2, chain), (3, chain), (4, None))  # kept
    # Sampled batch defaults are more tables, one by temperature: writing any keeps the
    # others, and every other writer keeps them all.
    assert read_batch_trees(tmp_path, temperature=1.0) == ()
    write_batch_trees(tmp_path, {2: chain, 3: None}, {"temperature": 1.0}, temperature=1.0)
    write_default_tree(tmp_path, TreeSpec("chain", depth=3), {}, vocab="fr:8192")
    write_sampled_default_tree(tmp_path, wide, {}, temperature=1.0)
    write_batch_trees(tmp_path, {2: wide, 3: None}, {})
    assert read_batch_trees(tmp_path, temperature=1.0) == ((2, chain), (3, None))
    assert read_batch_trees(tmp_path) == ((2, wide), (3, None))
    d = read_defaults(tmp_path)
    assert (d.tree, d.vocab, d.sampled_trees) == (TreeSpec("chain", depth=3), "fr:8192",
                                                 ((1.0, wide),))
    with pytest.raises(ValueError, match=r"sizes \[2\] were not measured"):
        write_batch_trees(tmp_path, {3: chain}, {}, temperature=1.0)
    text = json.loads((tmp_path / FILE).read_text())
    assert text["sampled_batch"]["temperatures"]["1"]["measured"] == {"temperature": 1.0}
    (tmp_path / FILE).write_text(json.dumps({**text, "batch": {"trees": {"x": None}}}))
    with pytest.raises(ValueError, match="not a valid default tree.*integers >= 2"):
        read_batch_trees(tmp_path)
    (tmp_path / FILE).write_text(json.dumps({**text, "sampled_batch": [None]}))
    with pytest.raises(ValueError, match="sampled_batch must be an object"):
        read_batch_trees(tmp_path, temperature=1.0)


def test_a_new_head_drops_the_entries_measured_with_the_old_one(tmp_path):
    chain = TreeSpec("chain", depth=1)
    write_default_tree(tmp_path, TreeSpec("chain", depth=2), {}, vocab="fr:8192")
    write_sampled_default_tree(tmp_path, chain, {}, temperature=0.3)
    write_batch_trees(tmp_path, {2: chain}, {})
    write_batch_trees(tmp_path, {2: chain}, {}, temperature=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same head keeps them, silently
        write_default_tree(tmp_path, TreeSpec("chain", depth=3), {}, vocab="fr:8192")
    d = read_defaults(tmp_path)
    assert d.sampled_trees and d.batch_trees and d.sampled_batch_trees
    write_machine_default_tree(tmp_path, chain, {}, machine="cpu-avx2")
    with pytest.warns(UserWarning, match=r"head changed from 'fr:8192' to 'full'.*"
                                         r"\['sampled', 'batch', 'sampled_batch', 'machines'\]"):
        write_default_tree(tmp_path, TreeSpec("chain", depth=3), {}, vocab="full")
    assert read_defaults(tmp_path) == (TreeSpec("chain", depth=3), "full", (), (), (), None)
    assert read_defaults(tmp_path, "cpu-avx2").tree == TreeSpec("chain", depth=3)


def test_sampled_batch_tables_by_temperature(tmp_path):
    """A table for sampling at each measured temperature; sampling at t follows the one
    measured nearest t, and a file's older one-table entry reads as measured at 1."""
    chain, lookup = TreeSpec("chain", depth=1), TreeSpec("chain", depth=1, lookup=4)
    write_default_tree(tmp_path, TreeSpec("chain", depth=3), {}, vocab="fr:8192")
    write_batch_trees(tmp_path, {2: chain, 3: None}, {"temperature": 1.0}, temperature=1.0)
    write_batch_trees(tmp_path, {2: lookup, 3: chain}, {"t": 0.3}, temperature=0.3)
    for t, table in ((0.1, ((2, lookup), (3, chain))), (0.3, ((2, lookup), (3, chain))),
                     (0.6, ((2, lookup), (3, chain))), (0.65, ((2, chain), (3, None))),
                     (1.0, ((2, chain), (3, None))), (2.0, ((2, chain), (3, None)))):
        assert read_batch_trees(tmp_path, temperature=t) == table, t
    # Measured again at 0.30 (spelled "0.3" in the file): replaced, not added beside.
    write_batch_trees(tmp_path, {2: chain}, {"t": 0.3, "again": True}, temperature=0.30)
    assert read_defaults(tmp_path).sampled_batch_trees == ((0.3, ((2, chain),)),
                                                          (1.0, ((2, chain), (3, None))))
    text = json.loads((tmp_path / FILE).read_text())
    assert set(text["sampled_batch"]["temperatures"]) == {"0.3", "1"}
    assert text["sampled_batch"]["temperatures"]["0.3"]["measured"]["again"]
    for bad in (-0.5, math.inf, math.nan):
        with pytest.raises(ValueError, match="finite temperature >= 0"):
            write_batch_trees(tmp_path, {2: chain}, {}, temperature=bad)
    # A file from before the tables were keyed by temperature held one, measured at 1.
    text["sampled_batch"] = {"trees": {"2": chain.to_json(), "3": None}, "measured": {}}
    (tmp_path / FILE).write_text(json.dumps(text))
    assert read_defaults(tmp_path).sampled_batch_trees == ((1.0, ((2, chain), (3, None))),)
    assert read_batch_trees(tmp_path, temperature=0.3) == ((2, chain), (3, None))
    write_batch_trees(tmp_path, {2: lookup}, {}, temperature=0.3)  # the old one stays, at 1
    assert read_batch_trees(tmp_path, temperature=0.9) == ((2, chain), (3, None))
    assert read_batch_trees(tmp_path, temperature=0.3) == ((2, lookup),)
    text["sampled_batch"] = {"temperatures": {"0": {"trees": {}}}}
    (tmp_path / FILE).write_text(json.dumps(text))
    with pytest.raises(ValueError, match="sampled_batch temperatures are numbers > 0"):
        read_defaults(tmp_path)


def test_generate_follows_the_batch_defaults(tiny_target, tmp_path):
    """A batch of n rows drafts the tree measured for the largest size <= n, or decodes
    without the drafter where vanilla decoding was measured faster (the same tokens); an
    explicit threshold overrides the measured one, and a given tree is the caller's."""
    drafter = EagleDrafter(DrafterConfig(tiny_target.cfg), rngs=nnx.Rngs(0))
    folder = save_drafter(tmp_path / "d", drafter.cfg, drafter.params())
    write_default_tree(folder, TreeSpec("chain", depth=2), {})
    write_batch_trees(folder, {2: TreeSpec("chain", depth=1), 3: TreeSpec("chain", depth=1),
                               4: None}, {})
    d = specjax.load_drafter(folder, tiny_target)
    assert [d.speculates_at(b) for b in (1, 2, 3, 4, 9)] == [True, True, True, False, False]
    assert d.tree_for(0, batch=3) == TreeSpec("chain", depth=1)
    assert d.tree_for(0, batch=1) == d.tree_for(0, batch=4) == TreeSpec("chain", depth=2)
    prompts = [[1, 17, 42, 99], [1, 5, 6], [1, 60, 61, 62, 63], [1, 9]]

    def run(n, **kw):
        return specjax.generate(tiny_target, prompts[:n], max_new_tokens=6, **kw)

    assert run(1, drafter=d).stats["tree"]["depth"] == 2
    # Sampled, a batch drafts the batch tree too: the tree for sampling was measured at one
    # row, and its width times the rows is what a batch cannot afford.
    wide = TreeSpec("dyspec-threshold", depth=1, total_tokens=3, threshold=0.001)
    write_sampled_default_tree(folder, wide, {}, temperature=1.0)
    ds = specjax.load_drafter(folder, tiny_target)
    assert ds.tree_for(1.0, batch=1) == wide
    assert ds.tree_for(1.0, batch=2) == ds.tree_for(1.0, batch=3) == TreeSpec("chain",
                                                                                 depth=1)
    assert run(1, drafter=ds, temperature=1.0).stats["tree"]["kind"] == "dyspec-threshold"
    assert run(2, drafter=ds, temperature=1.0).stats["tree"]["kind"] == "chain"
    # Where the folder measured sampled batches, sampling follows them instead, vanilla
    # decoding included, and greedy decoding still follows the greedy ones.
    write_batch_trees(folder, {2: TreeSpec("chain", depth=2), 3: None}, {}, temperature=1.0)
    dsb = specjax.load_drafter(folder, tiny_target)
    assert dsb.tree_for(1.0, batch=1) == wide
    assert dsb.tree_for(1.0, batch=2) == dsb.tree_for(0.2, batch=2) == TreeSpec("chain",
                                                                                depth=2)
    assert dsb.tree_for(0, batch=2) == TreeSpec("chain", depth=1)
    assert [dsb.speculates_at(b, 1.0) for b in (1, 2, 3, 4)] == [True, True, False, False]
    assert [dsb.speculates_at(b) for b in (1, 2, 3, 4)] == [True, True, True, False]
    with pytest.raises(TypeError, match="temperature"):
        dsb.speculates_at(3, False)  # the old speculates_at(batch, greedy) must not pass
    sampled_off = run(3, drafter=dsb, temperature=1.0, seed=3)
    assert sampled_off.tokens == run(3, temperature=1.0, seed=3).tokens
    assert ("stores vanilla decoding for this batch size" in sampled_off.stats[
        "speculation_off"] and "table for sampling at temperature 1," in sampled_off.stats[
        "speculation_off"])
    # Measured at 0.3 too: sampling at 0.4 follows that table, at 0.9 the one at 1.
    write_batch_trees(folder, {2: TreeSpec("chain", depth=3), 3: TreeSpec("chain", depth=1)},
                      {}, temperature=0.3)
    dst = specjax.load_drafter(folder, tiny_target)
    assert dst.tree_for(0.4, batch=3) == TreeSpec("chain", depth=1)
    assert dst.tree_for(0.4, batch=2) == TreeSpec("chain", depth=3)
    assert dst.tree_for(0.9, batch=2) == TreeSpec("chain", depth=2)
    assert [dst.speculates_at(3, t) for t in (0, 0.4, 0.9)] == [True, True, False]
    assert "mean_accepted_length" in run(3, drafter=dst, temperature=0.4, seed=3).stats
    assert run(2, drafter=dsb, temperature=1.0).stats["tree"]["depth"] == 2
    assert "speculation_off" not in run(3, drafter=dsb).stats
    two = run(3, drafter=d).stats
    assert two["tree"] == run(3, drafter=d, tree=TreeSpec("chain", depth=1)).stats["tree"]
    assert "speculation_off" not in two
    vanilla = run(4)
    off = run(4, drafter=d, vocab="full")
    assert off.tokens == vanilla.tokens and "mean_accepted_length" not in off.stats
    assert "stores vanilla decoding for this batch size" in off.stats["speculation_off"]
    assert "mean_accepted_length" in run(4, drafter=d, disable_by_batch_size=0).stats
    assert "mean_accepted_length" in run(4, drafter=d, tree=TreeSpec("chain", depth=1)).stats
    explicit = run(2, drafter=d, disable_by_batch_size=2)
    assert explicit.tokens == run(2).tokens
    assert "disable_by_batch_size=2" in explicit.stats["speculation_off"]
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        run(2, drafter=d, disable_by_batch_size=-1)
    # Measured up to 3 rows, drafting there: no tree was measured at 4, so none is drafted.
    write_batch_trees(folder, {2: TreeSpec("chain", depth=1), 3: TreeSpec("chain", depth=1)},
                      {})
    upto3 = specjax.load_drafter(folder, tiny_target)
    assert [upto3.speculates_at(b) for b in (1, 2, 3, 4, 9)] == [True, True, True, False,
                                                                  False]
    assert upto3.tree_for(0, batch=3) == TreeSpec("chain", depth=1)
    beyond = run(4, drafter=upto3, vocab="full")
    assert beyond.tokens == vanilla.tokens
    assert "measured trees up to 3 rows only" in beyond.stats["speculation_off"]


def test_a_machine_class_drafts_its_own_trees(tmp_path):
    """Trees stored for a machine class serve machines of that class at batch 1 (greedy, and
    sampling at the temperatures it has trees for); every other class, and every other
    entry, reads the file's main ones."""
    static = TreeSpec("static", paths=((0,), (1,), (0, 0)), lookup=8, lookup_min=2)
    chain, wide = TreeSpec("chain", depth=2, lookup=8, lookup_min=2), TreeSpec(
        "dyspec-threshold", depth=1, total_tokens=5, threshold=0.001)
    with pytest.raises(ValueError, match="does not exist; measure the greedy default first"):
        write_machine_default_tree(tmp_path, chain, {}, machine="cpu-avx2")
    write_default_tree(tmp_path, static, {"on": "avx512"}, vocab="fr:8192")
    write_sampled_default_tree(tmp_path, wide, {}, temperature=1.0)
    write_batch_trees(tmp_path, {2: chain}, {})
    write_machine_default_tree(tmp_path, chain, {"on": "avx2"}, machine="cpu-avx2")
    mine = read_defaults(tmp_path, "cpu-avx2")
    assert (mine.tree, mine.machine, mine.vocab) == (chain, "cpu-avx2", "fr:8192")
    assert mine.sampled_trees == ((1.0, wide),) and mine.batch_trees == ((2, chain),)
    other = read_defaults(tmp_path, "cpu-avx512f")
    assert (other.tree, other.machine) == (static, None)
    assert read_default_tree(tmp_path, machine="gpu") == static
    assert read_default_tree(tmp_path, machine="cpu-avx2", temperature=1.0) == wide
    # Re-measuring the main tree with the same head keeps the classes' trees.
    write_default_tree(tmp_path, static, {}, vocab="fr:8192")
    assert read_default_tree(tmp_path, machine="cpu-avx2") == chain
    text = json.loads((tmp_path / FILE).read_text())
    assert text["machines"]["cpu-avx2"]["measured"] == {"on": "avx2"}
    with pytest.raises(ValueError, match="machine class is a name"):
        write_machine_default_tree(tmp_path, chain, {}, machine="")
    # A class may store trees for sampling: by temperature, over the file's own, which
    # serve the temperatures the class has none at.
    hot = TreeSpec("dyspec-threshold", depth=1, total_tokens=3, threshold=0.001)
    write_sampled_default_tree(tmp_path, static, {}, temperature=0.3)
    write_machine_default_tree(tmp_path, hot, {"t": 1}, machine="cpu-avx2", temperature=1.0)
    mine = read_defaults(tmp_path, "cpu-avx2")
    assert mine.sampled_trees == ((0.3, static), (1.0, hot)) and mine.tree == chain
    assert read_defaults(tmp_path, "cpu-avx512f").sampled_trees == ((0.3, static), (1.0, wide))
    write_machine_default_tree(tmp_path, chain, {}, machine="cpu-sampled", temperature=0.7)
    only = read_defaults(tmp_path, "cpu-sampled")
    assert (only.tree, only.machine) == (static, "cpu-sampled")  # no greedy tree of its own
    assert only.sampled_trees == ((0.3, static), (0.7, chain), (1.0, wide))
    assert stored_greedy_trees(tmp_path) == (static, chain)  # the main one, then classes'
    text = json.loads((tmp_path / FILE).read_text())
    assert text["machines"]["cpu-avx2"]["sampled"]["temperatures"]["1"]["measured"] == {"t": 1}
    with pytest.raises(ValueError, match="finite temperature >= 0"):
        write_machine_default_tree(tmp_path, hot, {}, machine="cpu-avx2", temperature=-1.0)
    # This process reads its own class's entry (the suite runs on a CPU).
    assert machine_class() in ("cpu", "cpu-avx2", "cpu-avx512f")
    write_machine_default_tree(tmp_path, wide, {}, machine=machine_class())
    assert read_defaults(tmp_path).tree == wide
    (tmp_path / FILE).write_text(json.dumps({**text, "machines": {"cpu-avx2": {}}}))
    with pytest.raises(ValueError, match=r"not a valid default tree.*machines\['cpu-avx2'\]"):
        read_defaults(tmp_path)


def test_save_default_tree_for_a_machine_class(tmp_path):
    """``bench spec --save-default-tree --for-this-machine``: the run's tree goes to its
    machine class's entry (greedy, or for sampling at its temperature); a run on another
    class or with another head than the folder's is refused."""
    grid = [{"label": "chain d2", "est_speedup": 1.6}]
    result = {"config": {"tree_mode": "auto", "vocab": "fr:8192", "model": "m"},
              "greedy_equality": {"all_match": True}, "tree_label": "chain d2",
              "tree": TreeSpec("chain", depth=2).to_json(),
              "tree_selection": {"chosen": grid[0], "grid": grid},
              "overall": {"speedup": 1.49, "mal": 2.28, "prompts": 24},
              "machine": {"cpu_model": "x", "nproc": 2, "class": "cpu-avx2"}}
    with pytest.raises(ValueError, match="does not exist"):
        save_default_tree(result, tmp_path, machine="cpu-avx2")
    write_default_tree(tmp_path, TreeSpec("chain", depth=3), {}, vocab="fr:8192")
    saved = json.loads(save_default_tree(result, tmp_path, "r.json",
                                         machine="cpu-avx2").read_text())
    assert saved["tree"] == TreeSpec("chain", depth=3).to_json()  # the main tree stays
    entry = saved["machines"]["cpu-avx2"]
    assert entry["tree"] == TreeSpec("chain", depth=2).to_json()
    assert entry["measured"]["machine"]["class"] == "cpu-avx2"
    assert entry["measured"]["realized_speedup"] == 1.49
    for change, msg in [({"machine": {"class": "cpu-avx512f"}}, "ran on 'cpu-avx512f'"),
                        ({"config": {**result["config"], "vocab": "full"}},
                         "trees share 'fr:8192'")]:
        with pytest.raises(ValueError, match=msg):
            save_default_tree({**result, **change}, tmp_path, machine="cpu-avx2")
    # A sampled run's tree, chosen by its paired A/B, is the class's tree for sampling.
    ab = {"candidates": ["n5", "n3"], "prompts": 23, "decided_by": "speed",
          "results": [{"label": "n5", "vs_first": {"ratio": 1.0, "ci95": [1.0, 1.0]}},
                      {"label": "n3", "vs_first": {"ratio": 1.04, "ci95": [1.002, 1.08]}}]}
    n3 = TreeSpec("dyspec-threshold", depth=1, total_tokens=3, threshold=0.001)
    sampled = {**result, "config": {**result["config"], "greedy": False, "temperature": 1.0,
                                    "tree_mode": "paired"},
               "tree": n3.to_json(), "tree_label": "n3",
               "tree_selection": {**result["tree_selection"], "ab": ab}}
    saved = json.loads(save_default_tree(sampled, tmp_path, machine="cpu-avx2").read_text())
    entry = saved["machines"]["cpu-avx2"]
    assert entry["tree"] == TreeSpec("chain", depth=2).to_json()  # its greedy tree stays
    assert "sampled" not in saved  # the main trees for sampling are untouched
    one = entry["sampled"]["temperatures"]["1"]
    assert one["tree"] == n3.to_json() and "bench spec --temperature 1" in one["measured"]["how"]
    assert read_default_tree(tmp_path, machine="cpu-avx2", temperature=1.0) == n3
    assert read_default_tree(tmp_path, machine="cpu-avx512f", temperature=1.0) is None
