"""Router training on synthetic data: data files, labels, learning, resume, the CLI."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from specjax.drafter import DrafterConfig, EagleDrafter, save_drafter
from specjax.train.cli import main as train_main
from specjax.train.router import (
    RouterTrainConfig,
    cluster_labels,
    cluster_prior,
    read_router_data,
    train_router,
    write_router_meta,
    write_router_shard,
)
from specjax.vocab.clusters import Clusters, load_clusters
from specjax.vocab.router import (
    RouterMismatchError,
    fingerprint,
    load_router,
    target_fields_of,
)

D, V, M, L = 8, 48, 6, 2
FP = "f" * 64
TARGET = {"model_type": "llama", "vocab_size": V, "hidden_size": D}


def make_router_data(dir_, *, n: int = 3000, d: int = D, v: int = V, m: int = M, top_l: int = L,
                     fp: str = FP, seed: int = 0, shard: int = 1000,
                     assign: np.ndarray | None = None) -> np.ndarray:
    """Synthetic records whose positive clusters are a learnable function of x.

    Token scores are x @ W with each token's column near its cluster's direction,
    so the top tokens concentrate in the clusters x points at. The first half of
    x (the "embedding") is 10x smaller than the second, like the real inputs.
    Returns the token -> cluster map used.
    """
    rs = np.random.RandomState(seed)
    assign = np.arange(v) % m if assign is None else assign
    u = rs.randn(2 * d, m)
    w = 3.0 * u[:, assign] + 0.3 * rs.randn(2 * d, v)
    x = rs.randn(n, 2 * d).astype(np.float32)
    x[:, :d] *= 0.1
    topl = np.argsort(-(x @ w), axis=1)[:, :top_l]
    step = rs.randint(0, 10, n)
    for i, s in enumerate(range(0, n, shard)):
        write_router_shard(dir_, i, x[s:s + shard], topl[s:s + shard], step[s:s + shard])
    write_router_meta(dir_, in_dim=2 * d, top_l=top_l, vocab_size=v, drafter_fingerprint=fp,
                      num_records=n)
    return assign


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    dir_ = tmp_path_factory.mktemp("router_data")
    assign = make_router_data(dir_)
    return dir_, Clusters.from_assign(assign, M)


def _tc(**kw) -> RouterTrainConfig:
    base = dict(steps=150, batch=64, lr=3e-3, hidden=64, heldout_fraction=0.2,
                eval_ks=(1, 2, 3), checkpoint_every=50)
    return RouterTrainConfig(**(base | kw))


def test_data_files_round_trip_and_refusals(tmp_path):
    make_router_data(tmp_path / "a", n=25, shard=10)
    d = read_router_data(tmp_path / "a")
    assert len(d) == 25 and d.x.dtype == np.float16 and d.x.shape == (25, 2 * D)
    assert d.topl.shape == (25, L) and d.step.shape == (25,)
    assert d.meta["drafter_fingerprint"] == FP
    (tmp_path / "a" / "shard_00001.npz").rename(tmp_path / "a" / "shard_00007.npz")
    with pytest.raises(ValueError, match="without gaps"):
        read_router_data(tmp_path / "a")
    make_router_data(tmp_path / "b", n=25, shard=10)
    meta = json.loads((tmp_path / "b" / "meta.json").read_text())
    (tmp_path / "b" / "meta.json").write_text(json.dumps(meta | {"num_records": 30}))
    with pytest.raises(ValueError, match="25 records.*says 30"):
        read_router_data(tmp_path / "b")
    (tmp_path / "b" / "shard_00002.npz").write_bytes(b"junk")
    with pytest.raises(ValueError, match="unreadable"):
        read_router_data(tmp_path / "b")
    with pytest.raises(FileNotFoundError, match="meta.json"):
        read_router_data(tmp_path / "nothing")
    with pytest.raises(ValueError, match="one n"):
        write_router_shard(tmp_path / "c", 0, np.zeros((3, 4)), np.zeros((2, 1)), np.zeros(3))


def test_labels_mark_clusters_holding_a_top_token():
    assign = np.array([0, 1, 2, 0, 1, 2, 3])
    topl = np.array([[0, 3], [1, 6], [5, 5]])
    y = np.asarray(cluster_labels(jnp.asarray(topl), jnp.asarray(assign), 4))
    np.testing.assert_array_equal(y, [[1, 0, 0, 0], [0, 1, 0, 1], [0, 0, 1, 0]])
    np.testing.assert_allclose(cluster_prior(topl, assign, 4), y.mean(0))


def test_training_learns_the_routing(data, tmp_path):
    dir_, clusters = data
    m = train_router(dir_, clusters, _tc(), tmp_path / "router", drafter_fingerprint=FP,
                     target_fields=TARGET, progress=False)
    ini, fin, base = m["initial"], m["final"], m["static_baseline"]
    assert m["complete"] and m["steps"] == 150 and m["records"] == {"train": 2400,
                                                                    "heldout": 600}
    assert fin["bce"] < 0.5 * ini["bce"], (ini["bce"], fin["bce"])
    # prior init: the untrained router *is* the static frequency ranking.
    assert ini["recall@1"] == pytest.approx(base["recall@1"])
    assert fin["recall@1"] > ini["recall@1"] + 0.3, (ini, fin)
    assert fin["recall@3"] >= fin["recall@2"] >= fin["recall@1"]
    assert fin["shortlist@2"] == pytest.approx(2 * V / M)  # balanced synthetic clusters
    assert set(fin["by_step"]) == {"0", "1", "2", "3", "4", "5", "6", "7+"}

    cfg, params, cl, meta = load_router(tmp_path / "router", drafter_fingerprint=FP,
                                        target_fields=TARGET)
    np.testing.assert_array_equal(cl.assign, clusters.assign)
    assert meta["final"]["bce"] == fin["bce"] and cfg.hidden == 64
    assert (tmp_path / "router" / "loss.png").stat().st_size > 0
    assert json.loads((tmp_path / "router" / "metrics.json").read_text())["steps"] == 150


def test_resume_continues_rather_than_restarting(data, tmp_path):
    dir_, clusters = data
    tc = _tc(steps=12, checkpoint_every=4)
    kw = dict(drafter_fingerprint=FP, target_fields=TARGET, progress=False)
    full = train_router(dir_, clusters, tc, tmp_path / "a", **kw)
    part = train_router(dir_, clusters, tc, tmp_path / "b", stop_after=6, **kw)
    assert part["steps"] == 6 and not part["complete"] and part["out"] is None
    assert not (tmp_path / "b").exists()
    with pytest.raises(FileExistsError, match="--resume"):
        train_router(dir_, clusters, tc, tmp_path / "b", **kw)
    resumed = train_router(dir_, clusters, tc, tmp_path / "b", resume=True, **kw)
    assert resumed["complete"] and resumed["steps"] == 12
    log = json.loads((tmp_path / "b" / "training_log.json").read_text())
    assert log["resumed_at"] == [6] and [r["step"] for r in log["train"]] == list(range(1, 13))
    assert [r["tag"] for r in log["eval"]] == ["initial", "final"]
    pa = load_router(tmp_path / "a", drafter_fingerprint=FP, target_fields=TARGET)[1]
    pb = load_router(tmp_path / "b", drafter_fingerprint=FP, target_fields=TARGET)[1]
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-6)
    assert resumed["final"]["bce"] == pytest.approx(full["final"]["bce"], abs=1e-5)
    with pytest.raises(ValueError, match="other training settings"):
        train_router(dir_, clusters, _tc(steps=12, checkpoint_every=4, lr=1e-2),
                     tmp_path / "c", ckpt_dir=tmp_path / "b.checkpoints", resume=True, **kw)


def test_compare_with_evaluates_saved_routers_on_the_same_heldout(data, tmp_path):
    dir_, clusters = data
    kw = dict(drafter_fingerprint=FP, target_fields=TARGET, progress=False)
    short = train_router(dir_, clusters, _tc(steps=3), tmp_path / "short", **kw)
    again = train_router(dir_, clusters, _tc(steps=3), tmp_path / "again",
                         compare_with=(tmp_path / "short",), **kw)
    [c] = again["compared"]
    assert c["router"] == str(tmp_path / "short")
    # The saved router, evaluated through its stored params, scores what training saw.
    for k in ("bce", "recall@1", "recall@3", "top1_recall@2", "shortlist@2"):
        assert c["final"][k] == pytest.approx(short["final"][k], abs=1e-5), k
    longer = train_router(dir_, clusters, _tc(steps=40), tmp_path / "longer",
                          compare_with=(tmp_path / "short",), **kw)
    assert longer["final"]["bce"] < longer["compared"][0]["final"]["bce"]
    saved = json.loads((tmp_path / "longer" / "metrics.json").read_text())
    assert saved["compared"][0]["final"]["recall@1"] == c["final"]["recall@1"]
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "short", other)
    manifest = json.loads((other / "specjax.json").read_text())
    (other / "specjax.json").write_text(json.dumps({**manifest,
                                                    "drafter_fingerprint": "0" * 64}))
    with pytest.raises(RouterMismatchError, match="another drafter"):
        train_router(dir_, clusters, _tc(steps=3), tmp_path / "x", compare_with=(other,), **kw)
    assert not (tmp_path / "x").exists()


def test_refuses_mismatched_inputs(data, tmp_path):
    dir_, clusters = data
    kw = dict(progress=False)
    with pytest.raises(RouterMismatchError, match="another drafter"):
        train_router(dir_, clusters, _tc(), tmp_path / "r", drafter_fingerprint="0" * 64,
                     target_fields=TARGET, **kw)
    with pytest.raises(RouterMismatchError, match="in_dim"):
        train_router(dir_, clusters, _tc(), tmp_path / "r", drafter_fingerprint=FP,
                     target_fields=TARGET | {"hidden_size": 16}, **kw)
    with pytest.raises(RouterMismatchError, match="vocab_size"):
        train_router(dir_, Clusters.from_assign(np.arange(V + 1) % M, M), _tc(),
                     tmp_path / "r", drafter_fingerprint=FP, target_fields=TARGET, **kw)
    with pytest.raises(ValueError, match="top_l"):
        train_router(dir_, clusters, _tc(top_l=5), tmp_path / "r", drafter_fingerprint=FP,
                     target_fields=TARGET, **kw)
    with pytest.raises(ValueError, match="batch"):
        train_router(dir_, clusters, _tc(batch=5000), tmp_path / "r", drafter_fingerprint=FP,
                     target_fields=TARGET, **kw)


@pytest.fixture(scope="module")
def tiny(tiny_llama, tmp_path_factory):
    """A converted tiny target and two random drafters for it."""
    root = tmp_path_factory.mktemp("router_cli")
    target = specjax.load(specjax.convert(tiny_llama, root / "target", progress=False))
    drafters = []
    for seed in (0, 1):
        dcfg = DrafterConfig(target=target.cfg)
        dp = EagleDrafter(dcfg, rngs=nnx.Rngs(seed)).params()
        drafters.append(save_drafter(root / f"drafter{seed}", dcfg, dp))
    return target, drafters


def test_cli_end_to_end(tiny, tmp_path, capsys):
    target, (drafter, other) = tiny
    d, v = target.cfg.hidden_size, target.cfg.vocab_size
    fp = fingerprint(specjax.load_drafter(drafter, target).params)
    make_router_data(tmp_path / "data", n=400, d=d, v=v, m=8, top_l=3, fp=fp, shard=150)
    args = ["router", "--target", str(target.path), "--drafter", str(drafter), "--data",
            str(tmp_path / "data"), "--out", str(tmp_path / "r"), "--clusters", "8",
            "--kmeans-iters", "3", "--steps", "6", "--batch-size", "32", "--hidden", "32",
            "--eval-ks", "2,4", "--checkpoint-every", "3", "--save-clusters",
            str(tmp_path / "c.npz"), "--no-progress"]
    assert train_main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 6 and out["complete"] and out["clusters"] == 8
    assert out["heldout_bce"] is not None and 0 <= out["recall@2"] <= out["recall@4"] <= 1
    saved = load_clusters(tmp_path / "c.npz")
    cfg, _, clusters, meta = load_router(tmp_path / "r", drafter_fingerprint=fp,
                                         target_fields=target_fields_of(target.cfg, saved))
    np.testing.assert_array_equal(clusters.assign, saved.assign)
    assert cfg.in_dim == 2 * d and cfg.num_clusters == 8 and meta["command"]
    assert meta["clusters_source"]["kmeans"]["num_clusters"] == 8

    assert train_main(args) == 2  # --out exists: a one-line error
    assert "--overwrite" in capsys.readouterr().err
    reuse = args[:args.index("--clusters")] + ["--clusters-file", str(tmp_path / "c.npz"),
                                               "--out", str(tmp_path / "r2")]
    reuse += args[args.index("--kmeans-iters"):args.index("--save-clusters")] + [
        "--no-progress", "--compare-with", str(tmp_path / "r")]
    assert train_main(reuse) == 0
    [compared] = json.loads(capsys.readouterr().out)["compared"]
    # The same clusters, settings and seed: the earlier router scores what this one does.
    assert compared["router"] == str(tmp_path / "r")
    assert compared["recall@2"] == pytest.approx(out["recall@2"], abs=1e-6)
    _, _, again, _ = load_router(tmp_path / "r2", drafter_fingerprint=fp,
                                 target_fields=target_fields_of(target.cfg))
    np.testing.assert_array_equal(again.assign, saved.assign)

    wrong = [a if a != str(drafter) else str(other) for a in args]
    wrong[wrong.index(str(tmp_path / "r"))] = str(tmp_path / "r3")
    assert train_main(wrong) == 2
    assert "another drafter" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--eval-ks", "2,four"], "--eval-ks must be comma-separated integers"),
    (["--budget", "64,32"], "--budget must be K0,K1,KF"),
    (["--budget", "32,64,32"], "needs 1 <= K1 <= K0"),  # routed_head would refuse it at use
    (["--budget", "64,32,0"], "KF >= 1"),
    (["--cluster-cap", "-1"], "--cluster-cap must be >= 0"),
])
def test_cli_refuses_bad_flags_before_loading(tmp_path, capsys, flags, message):
    args = ["router", "--target", str(tmp_path / "no-target"), "--data", str(tmp_path / "d"),
            "--out", str(tmp_path / "r"), "--no-progress", *flags]
    assert train_main(args) == 2  # the target folder does not exist: refused before it
    assert message in capsys.readouterr().err and not (tmp_path / "r").exists()
