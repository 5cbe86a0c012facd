"""``--vocab`` specs on the real SmolLM2 target with the shipped drafter, counts and router."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import specjax
from specjax.bench.phases import random_drafter
from specjax.defaults import default_drafter_dir
from specjax.vocab import resolve_head
from specjax.vocab.dynaspec import RoutedHead
from specjax.vocab.fr_head import FrequencyHead
from specjax.vocab.router import RouterMismatchError


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    target = specjax.load(smollm2_dir)
    return target, specjax.load_drafter(default_drafter_dir(), target)


def test_shipped_artifacts_resolve(smollm2):
    target, drafter = smollm2
    fr = resolve_head("fr:8192", target, drafter)
    assert isinstance(fr, FrequencyHead) and fr.capacity(3) == 8192
    ids = np.asarray(fr.ids)
    assert {1, 2} <= set(ids[:2].tolist())  # <|im_start|> and EOS <|im_end|> lead the list
    pa = resolve_head("pafr:32768", target, drafter)
    assert [pa.capacity(t) for t in range(4)] == [32768, 32768, 10922, 8192]
    ds = resolve_head("dynaspec", target, drafter)
    assert isinstance(ds, RoutedHead) and ds.position_aware and (ds.k0, ds.k1) == (64, 32)
    assert [ds.budget(t) for t in range(4)] == [64, 32, 8, 5]
    f = resolve_head("dynaspec-f-shared", target, drafter)
    assert not f.position_aware and f.shared and f.budget(3) == 32


def test_greedy_output_is_the_targets_with_the_shipped_router(smollm2):
    target, drafter = smollm2
    prompt = "Name three primary colors."
    vanilla = specjax.generate(target, prompt, max_new_tokens=12).tokens
    res = specjax.generate(target, prompt, max_new_tokens=12, drafter=drafter,
                           vocab="dynaspec", tree=specjax.TreeSpec("chain", depth=3))
    assert res.tokens == vanilla
    assert 0 < res.stats["mean_shortlist_size"] < 0.25 * target.cfg.vocab_size


def test_evospec_resolves_with_the_shipped_graph(smollm2):
    from specjax.vocab.evospec import EvoSpecHead

    target, drafter = smollm2
    evo = resolve_head("evospec", target, drafter)
    assert isinstance(evo, EvoSpecHead) and evo.name == "evospec:8192+256"
    assert evo.capacity(0) == 8192 + 256 and evo.successors.shape == (49152, 8)
    assert {1, 2} <= set(np.asarray(evo.core_ids[:2]).tolist())
    bare = resolve_head("evospec:2048+64:none", target, drafter)
    assert bare.capacity(3) == 2048 + 64 and bare.successors.shape[1] == 0
    prompt = "Name three primary colors."
    vanilla = specjax.generate(target, prompt, max_new_tokens=12).tokens
    res = specjax.generate(target, prompt, max_new_tokens=12, drafter=drafter,
                           vocab=evo, tree=specjax.TreeSpec("chain", depth=3))
    assert res.tokens == vanilla and res.stats["vocab"] == "evospec:8192+256"
    assert len(res.stats["oov_events"]) == 1
    with pytest.raises(FileNotFoundError, match="build-graph"):
        resolve_head("evospec:8192+256:/nowhere/graph", target, drafter)


@pytest.mark.parametrize("spec, match", [
    ("nope", "unknown vocab"), ("fr", "fr:N"), ("fr:many", "fr:N"), ("full:x", "unknown"),
    ("fr:100000", "exceeds"), ("fr:1", "cannot hold"), ("evospec:8192", "NS\\+ND"),
    ("evospec:8192+x", "NS\\+ND"), ("evospec:100+49100", "N_dyn"),
])
def test_bad_specs_are_refused(smollm2, spec, match):
    target, drafter = smollm2
    with pytest.raises(ValueError, match=match):
        resolve_head(spec, target, drafter)


def test_counts_from_another_tokenizer_are_refused(smollm2, tmp_path):
    target, drafter = smollm2
    src = default_drafter_dir() / "freq_counts"
    shutil.copy(src.with_suffix(".npy"), tmp_path / "c.npy")
    meta = json.loads(src.with_suffix(".json").read_text())
    meta["tokenizer_fingerprint"] = "0" * 64
    (tmp_path / "c.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="another tokenizer"):
        resolve_head(f"fr:8192:{tmp_path / 'c.npy'}", target, drafter)


def test_a_router_for_another_drafter_is_refused(smollm2):
    target, _ = smollm2
    other = random_drafter(target)  # same shapes, other weights
    with pytest.raises(RouterMismatchError, match="another drafter"):
        resolve_head(f"dynaspec:{default_drafter_dir() / 'router'}", target, other)


def test_a_drafter_without_artifacts_says_how_to_make_them(smollm2):
    target, _ = smollm2
    other = random_drafter(target)  # no folder, so no freq_counts.npy or router/
    with pytest.raises(ValueError, match="build-shortlist"):
        resolve_head("fr:8192", target, other)
    with pytest.raises(ValueError, match="train router"):
        resolve_head("dynaspec", target, other)
