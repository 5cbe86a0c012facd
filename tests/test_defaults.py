"""Named models for --model: the name selects the cached conversion; a folder wins."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

import specjax
from specjax.checkpoint import MANIFEST
from specjax.defaults import (
    GEMMA3_MODEL_NAME,
    SHIPPED_DRAFTERS,
    resolve_model,
    shipped_drafter_for,
)


def test_a_name_selects_the_cached_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_HOME", str(tmp_path / "home"))
    cached = tmp_path / "home" / GEMMA3_MODEL_NAME
    cached.mkdir(parents=True)
    (cached / MANIFEST).write_text("{}")  # already converted: nothing is read or converted
    monkeypatch.chdir(tmp_path)
    assert resolve_model(GEMMA3_MODEL_NAME) == cached
    (tmp_path / GEMMA3_MODEL_NAME).mkdir()  # a folder of that name is what the user means
    assert resolve_model(GEMMA3_MODEL_NAME) == Path(GEMMA3_MODEL_NAME)


def test_an_unknown_name_is_a_path(tmp_path):
    assert resolve_model(tmp_path / "gemma3-1b") == tmp_path / "gemma3-1b"
    from specjax.defaults import ensure_default_target

    with pytest.raises(ValueError, match="unknown model name 'gemma3-1b'; named models: "):
        ensure_default_target(name="gemma3-1b")


def test_each_shipped_drafter_is_found_for_its_target_and_no_other(tiny_target):
    from specjax.drafter import DrafterConfig
    from specjax.tree.default import (
        read_batch_trees,
        read_default_tree,
        read_default_vocab,
        read_defaults,
    )

    folders = sorted(p.parent for p in SHIPPED_DRAFTERS.glob("*/specjax.json"))
    assert {f.name for f in folders} >= {"SmolLM2-135M-Instruct", GEMMA3_MODEL_NAME}
    for folder in folders:
        cfg = DrafterConfig.from_json(json.loads((folder / "specjax.json").read_text())["config"])
        assert shipped_drafter_for(cfg.target) == folder
        # Its measured defaults parse, and its head's artifacts are in the folder.
        assert read_default_tree(folder) is not None
        assert all(read_default_tree(folder, machine=m) is not None
                   for m in ("cpu-avx2", "cpu-avx512f", "gpu"))  # each class's, or the main
        assert all(t > 0 for t, _ in read_defaults(folder).sampled_trees)
        tables = [read_batch_trees(folder)] + [t for _, t in read_defaults(folder)
                                               .sampled_batch_trees]
        assert all(size >= 2 for table in tables for size, _ in table)
        assert all(t > 0 for t, _ in read_defaults(folder).sampled_batch_trees)
        if read_default_vocab(folder).startswith(("fr", "pafr")):
            assert (folder / "freq_counts.npy").is_file()
    assert shipped_drafter_for(tiny_target.cfg) is None


def test_generate_decodes_vanilla_for_a_target_without_a_shipped_drafter(tiny_target,
                                                                         capsys):
    from specjax.commands.generate import _resolve_drafter

    args = argparse.Namespace(drafter=None, model=str(tiny_target.path))
    assert _resolve_drafter(args, tiny_target) is None
    assert "no drafter is shipped for the target" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs a drafter"):
        specjax.generate(tiny_target, [[1, 2]], max_new_tokens=2, vocab="fr:8")


def test_each_shipped_records_chosen_label_names_its_stored_tree():
    """A/B records key trees by ``tree_label``: the one a record says it chose must be the
    label of the tree stored beside it, or a later label change left stale records."""
    from specjax.bench.trees import tree_label
    from specjax.speculative import TreeSpec

    def entries(node):
        if isinstance(node, dict):
            measured = node.get("measured")
            if isinstance(node.get("tree"), dict) and isinstance(measured, dict) \
                    and isinstance(measured.get("chosen"), str):
                yield node["tree"], measured
            for v in node.values():
                yield from entries(v)
        elif isinstance(node, list):
            for v in node:
                yield from entries(v)

    checked = 0
    for path in sorted(SHIPPED_DRAFTERS.glob("*/default_tree.json")):
        for tree, measured in entries(json.loads(path.read_text())):
            label = tree_label(TreeSpec.from_json(tree))
            assert measured["chosen"] == label, (path.parent.name, label)
            assert label in measured.get("paired", {label: None}), (path.parent.name, label)
            checked += 1
    assert checked >= 8  # both drafters' temperature and machine-class entries
