"""DynaSpec router: the pure forward, fingerprints, save/load and its refusals."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.checkpoint import CheckpointError
from specjax.vocab.clusters import Clusters
from specjax.vocab.router import (
    Router,
    RouterConfig,
    RouterMismatchError,
    fingerprint,
    load_router,
    router_logits,
    save_router,
)

D, V, M = 8, 40, 6
TARGET = {"model_type": "llama", "vocab_size": V, "hidden_size": D}


def _router(seed: int = 0, **kw) -> tuple[RouterConfig, Router]:
    cfg = RouterConfig(in_dim=2 * D, num_clusters=M, hidden=16, **kw)
    return cfg, Router(cfg, rngs=nnx.Rngs(seed))


def _clusters() -> Clusters:
    return Clusters.from_assign(np.arange(V) % M, M, head_fingerprint="abc")


def test_logits_shape_module_equals_pure_and_norm_equalises_the_halves():
    cfg, model = _router()
    p = model.params()
    assert [k.shape for k in p.kernels] == [(2 * D, 16), (16, M)]
    assert p.norm_scale.shape == (2, D)
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 2 * D))
    out = router_logits(p, x)
    assert out.shape == (3, 5, M)
    np.testing.assert_allclose(np.asarray(model(x)), np.asarray(out), rtol=1e-6)
    # Each half is RMS-normalised on its own: rescaling one half (e.g. the embedding's
    # small scale) does not change the logits.
    scaled = x.at[..., :D].multiply(0.1).at[..., D:].multiply(30.0)
    np.testing.assert_allclose(np.asarray(router_logits(p, scaled)), np.asarray(out),
                               rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(np.asarray(router_logits(p, x.astype(jnp.float16))),
                               np.asarray(out), atol=2e-2)
    # No norm, one layer: a linear classifier.
    _, lin = _router(num_layers=1, norm_groups=0)
    lp = lin.params()
    assert lp.norm_scale is None and len(lp.kernels) == 1
    np.testing.assert_allclose(np.asarray(router_logits(lp, x)),
                               np.asarray(x @ lp.kernels[0] + lp.biases[0]), rtol=1e-5)
    with pytest.raises(ValueError, match="divisible"):
        RouterConfig(in_dim=7, num_clusters=3)
    assert RouterConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg


def test_fingerprint_is_stable_dtype_blind_and_value_sensitive():
    _, a = _router(0)
    _, b = _router(1)
    pa = a.params()
    assert fingerprint(pa) == fingerprint(a.params())
    assert fingerprint(pa) == fingerprint(jax.tree.map(lambda t: t.astype(jnp.bfloat16), pa))
    assert fingerprint(pa) != fingerprint(b.params())
    bumped = jax.tree.map(lambda t: t, pa)
    bumped = type(pa)(kernels=(pa.kernels[0].at[0, 0].add(1.0), pa.kernels[1]),
                      biases=pa.biases, norm_scale=pa.norm_scale)
    assert fingerprint(bumped) != fingerprint(pa)
    assert len(fingerprint(pa)) == 64


@pytest.fixture
def saved(tmp_path):
    cfg, model = _router()
    path = save_router(tmp_path / "router", model.params(), cfg, _clusters(),
                       drafter_fingerprint="d" * 64, target_fields=TARGET,
                       extra={"note": "test"})
    return path, cfg, model.params()


def test_save_load_round_trip(saved):
    path, cfg, params = saved
    cfg2, params2, clusters, meta = load_router(path, drafter_fingerprint="d" * 64,
                                                target_fields=TARGET)
    assert cfg2 == cfg and meta == {"note": "test"}
    for x, y in zip(jax.tree.leaves(params2), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_array_equal(clusters.assign, _clusters().assign)
    assert clusters.head_fingerprint == "abc"
    # Fewer target fields given: only those are compared.
    load_router(path, drafter_fingerprint="d" * 64, target_fields={"vocab_size": V})
    _, p16, _, _ = load_router(path, drafter_fingerprint="d" * 64, target_fields=TARGET,
                               dtype="bfloat16")
    assert p16.kernels[0].dtype == jnp.bfloat16
    with pytest.raises(FileExistsError, match="--overwrite"):
        save_router(path, params, cfg, _clusters(), drafter_fingerprint="x",
                    target_fields=TARGET)


def test_refuses_another_drafter_or_target(saved):
    path, _, _ = saved
    with pytest.raises(RouterMismatchError, match="another drafter.*specjax train router"):
        load_router(path, drafter_fingerprint="e" * 64, target_fields=TARGET)
    with pytest.raises(RouterMismatchError, match="vocab_size: router 40 vs target 41"):
        load_router(path, drafter_fingerprint="d" * 64, target_fields=TARGET | {"vocab_size": 41})
    with pytest.raises(RouterMismatchError, match="hidden_size.*specjax train router"):
        load_router(path, drafter_fingerprint="d" * 64, target_fields=TARGET | {"hidden_size": 9})


def test_save_refuses_inconsistent_inputs(tmp_path):
    cfg, model = _router()
    with pytest.raises(ValueError, match="outputs"):
        save_router(tmp_path / "r", model.params(), cfg,
                    Clusters.from_assign(np.arange(V) % 3, 3), drafter_fingerprint="d",
                    target_fields=TARGET)
    with pytest.raises(ValueError, match="hidden_size"):
        save_router(tmp_path / "r", model.params(), cfg, _clusters(), drafter_fingerprint="d",
                    target_fields={"vocab_size": V})
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("damage", ["missing", "no-manifest", "bad-manifest", "other-format",
                                    "no-params", "bad-clusters"])
def test_refuses_missing_or_corrupt_folders(saved, tmp_path, damage):
    path, _, _ = saved
    if damage == "missing":
        path = tmp_path / "nope"
    elif damage == "no-manifest":
        (path / "specjax.json").unlink()
    elif damage == "bad-manifest":
        (path / "specjax.json").write_text("{")
    elif damage == "other-format":
        m = json.loads((path / "specjax.json").read_text())
        (path / "specjax.json").write_text(json.dumps(m | {"format": "specjax-drafter"}))
    elif damage == "no-params":
        shutil.rmtree(path / "params")
    elif damage == "bad-clusters":
        (path / "clusters.npz").write_bytes(b"garbage")
    match = {"missing": "no such router folder", "no-manifest": "not a router folder",
             "bad-manifest": "corrupt", "other-format": "expected 'specjax-router'",
             "no-params": "cannot restore", "bad-clusters": "bad clusters"}[damage]
    with pytest.raises(CheckpointError, match=match):
        load_router(path, drafter_fingerprint="d" * 64, target_fields=TARGET)
