"""Drafter training on a tiny random Llama: training, resume, export (the data and the
hidden-state cache: test_data.py)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from specjax.drafter import read_drafter
from specjax.model import forward_hidden, init_cache
from specjax.train.cli import _drafter_layers
from specjax.train.cli import main as train_main
from specjax.train.data import (
    cache_hidden_states,
    device_hidden_states,
    gather_rows,
    load_split,
    row_loss_mask,
)
from specjax.train.drafter import (
    TrainConfig,
    compiled_steps,
    evaluate,
    init_drafter,
    lstsq_fc,
    train_drafter,
    training_buckets,
    write_drafter,
)
from tests.tiny import make_hf_checkpoint
from tests.train.tiny_data import sequences


def test_training_buckets_keep_short_splits_and_stay_fine_for_long_ones():
    """Up to 512 tokens the four buckets every cache so far used; past that, no gap over 128
    tokens, so a short conversation in a split with long ones is not padded to 300."""
    assert training_buckets(np.array([20, 480])) == (128, 240, 368, 480)
    long = training_buckets(np.array([20, 1184]))
    assert long[:4] == (128, 240, 368, 480) and long[-1] == 1184
    assert max(np.diff((0,) + long)) <= 128


def _tc(**kw) -> TrainConfig:
    base = dict(steps=30, token_budget=128, lr=1e-2, warmup_fraction=0.1, checkpoint_every=10,
                noise=0.2, fc_init="normal")
    return TrainConfig(**(base | kw))


def test_bfloat16_steps_track_float32_and_keep_float32_weights(target, cache, tmp_path):
    """--compute-dtype bfloat16: mixed precision. The step's loss is float32's to bf16's
    precision; the weights and optimizer stay float32; 30 steps learn as float32's do;
    evaluation runs in float32 (the initial held-out figures are identical)."""
    train, held = load_split(cache, "train"), load_split(cache, "heldout")
    runs = {dt: train_drafter(target.cfg, target.params, train, held,
                              _tc(compute_dtype=dt, drafter_taps=()), tmp_path / dt,
                              progress=False)
            for dt in ("float32", "bfloat16")}
    f32, b16 = (runs[k].log for k in ("float32", "bfloat16"))
    figures = [{k: v for k, v in log["eval"][0].items() if k != "eval_s"} for log in (f32, b16)]
    assert figures[0] == figures[1]  # step 0, evaluated in float32 both
    first = f32["train"][0]["loss"], b16["train"][0]["loss"]
    assert first[1] == pytest.approx(first[0], rel=2e-2) and first[1] != first[0]
    ev = {k: {r["tag"]: r for r in runs[k].log["eval"]} for k in runs}
    for k in runs:  # both learn (cf. test_training_decreases_loss_and_exports)
        assert ev[k]["final"]["loss"] < 0.6 * ev[k]["initial"]["loss"], ev
    assert ev["bfloat16"]["final"]["loss"] == pytest.approx(ev["float32"]["final"]["loss"],
                                                            rel=0.1)
    assert {a.dtype for a in jax.tree.leaves(runs["bfloat16"].params)} == {np.dtype(np.float32)}
    assert b16["train_config"]["compute_dtype"] == "bfloat16"
    assert "compute_dtype" not in f32["train_config"]  # older checkpoints resume unchanged
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        init_drafter(target.cfg, target.params, _tc(compute_dtype="float16"))


def test_least_squares_fc_init_beats_random(target, cache):
    train, held = load_split(cache, "train"), load_split(cache, "heldout")
    tc = _tc(fc_init="lstsq")
    w, b = lstsq_fc(train, target.params.embed)
    assert w.shape == (2 * target.cfg.hidden_size, target.cfg.hidden_size)
    initial = {}
    for fc_init in ("normal", "lstsq"):
        model = init_drafter(target.cfg, target.params, tc)
        if fc_init == "lstsq":
            model.fc[...], model.fc_bias[...] = jnp.asarray(w), jnp.asarray(b)
        graphdef, params = nnx.split(model, nnx.Param)
        _, _, eval_step = compiled_steps(graphdef, tc, 30)
        initial[fc_init] = evaluate(eval_step, params, target.params.embed, target.params.head,
                                    held, 128, tc.ce_weight)
    assert initial["lstsq"]["loss"] < 0.8 * initial["normal"]["loss"], initial


def test_least_squares_fc_reads_runs_of_sequences_and_solves_the_normal_equations(target,
                                                                                   cache):
    train = load_split(cache, "train")
    emb = np.asarray(target.params.embed, np.float64)
    d = emb.shape[1]
    xs, ys = [], []  # every scored row of every sequence, built one sequence at a time
    for i in range(len(train)):
        s, n = int(train.offsets[i]), int(train.lengths[i])
        f = train.hidden[s:s + n].astype(np.float64)
        m = row_loss_mask(train.assistant[s:s + n], n)
        prev = np.concatenate([np.zeros((1, d)), f[:-1]])
        xs.append(np.concatenate([emb[train.tokens[s:s + n]], prev, np.ones((n, 1))], 1)[m])
        ys.append(f[m])
    x, y = np.concatenate(xs), np.concatenate(ys)
    xtx = x.T @ x
    want = np.linalg.solve(xtx + 1e-3 * np.trace(xtx) / len(xtx) * np.eye(len(xtx)), x.T @ y)
    # The sequences in another order in the flat arrays, the features on the device: the
    # runs follow the offsets, whatever the split's order.
    perm = np.random.default_rng(0).permutation(len(train))
    moved = dataclasses.replace(train, lengths=train.lengths[perm],
                                offsets=train.offsets[perm], index=train.index[perm],
                                hidden=jnp.asarray(train.hidden))
    longest = int(train.lengths.max())
    for split, chunk in ((train, 16384), (train, 1), (moved, longest + 3), (moved, 10**9)):
        w, b = lstsq_fc(split, target.params.embed, chunk_rows=chunk)
        np.testing.assert_allclose(np.concatenate([w, b[None]]), want, rtol=2e-3, atol=2e-4)

    class Reads:  # counts the slices taken of the features, and their sizes
        def __init__(self, a):
            self.a, self.n, self.sizes = a, 0, set()

        def __getitem__(self, key):
            self.n += 1
            self.sizes.add(key.stop - key.start)
            return self.a[key]

    # A run ends where the next sequence would pass chunk_rows: with 4x the longest, every
    # run but the last holds at least four sequences.
    for chunk, most in ((10**9, 1), (4 * longest, -(-len(train) // 4))):
        reads = Reads(train.hidden)
        lstsq_fc(dataclasses.replace(moved, hidden=reads), target.params.embed, chunk_rows=chunk)
        assert 1 <= reads.n <= most < len(train), (chunk, reads.n)
        assert len(reads.sizes) == 1, reads.sizes  # one compiled slice on a device


def test_training_decreases_loss_and_exports(target, cache, tmp_path):
    train, held = load_split(cache, "train"), load_split(cache, "heldout")
    res = train_drafter(target.cfg, target.params, train, held, _tc(), tmp_path / "ckpt",
                        progress=False)
    ev = {r["tag"]: r for r in res.log["eval"]}
    assert ev["final"]["loss"] < 0.6 * ev["initial"]["loss"], ev
    losses = [r["loss"] for r in res.log["train"]]
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5]), losses
    assert res.meta["steps"] == 30 and res.meta["complete"]
    assert res.meta["heldout_top1"] == ev["final"]["top1"]

    out = write_drafter(tmp_path / "drafter", res, {"command": "test"})
    cfg, dp, meta = read_drafter(out, target.cfg)
    assert cfg == res.cfg and dp.layers[0].attn_norm is None
    for a, b in zip(jax.tree.leaves(dp), jax.tree.leaves(res.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert meta["tokens_seen"] == res.meta["tokens_seen"] > 0 and meta["command"] == "test"
    assert (out / "loss.png").stat().st_size > 0
    assert json.loads((out / "training_log.json").read_text())["meta"]["steps"] == 30


def test_resume_continues_at_the_right_step_with_identical_params(target, cache, tmp_path):
    train, held = load_split(cache, "train"), load_split(cache, "heldout")
    tc = _tc(steps=12, checkpoint_every=4, max_eval_tokens=64, fc_init="lstsq")
    full = train_drafter(target.cfg, target.params, train, held, tc, tmp_path / "a",
                         progress=False)
    part = train_drafter(target.cfg, target.params, train, held, tc, tmp_path / "b",
                         stop_after=6, progress=False)  # checkpoints at 4 and 6, then "dies"
    assert part.meta["steps"] == 6 and not part.meta["complete"]
    with pytest.raises(FileExistsError, match="--resume"):
        train_drafter(target.cfg, target.params, train, held, tc, tmp_path / "b", progress=False)
    resumed = train_drafter(target.cfg, target.params, train, held, tc, tmp_path / "b",
                            resume=True, progress=False)
    assert resumed.log["resumed_at"] == [6]
    assert [r["step"] for r in resumed.log["train"]] == list(range(1, 13))
    assert resumed.meta["tokens_seen"] == full.meta["tokens_seen"]
    for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(full.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="other training settings"):
        train_drafter(target.cfg, target.params, train, held,
                      _tc(steps=12, lr=1e-3, fc_init="lstsq"),
                      tmp_path / "b", resume=True, progress=False)


def test_time_limit_checkpoints_and_returns_an_incomplete_drafter(target, cache, tmp_path):
    train, held = load_split(cache, "train"), load_split(cache, "heldout")
    tc = _tc(steps=12, checkpoint_every=100, max_eval_tokens=64)
    part = train_drafter(target.cfg, target.params, train, held, tc, tmp_path / "a",
                         time_limit=0.0, progress=False)  # out of time after the first step
    assert part.meta["steps"] == 1 and not part.meta["complete"]
    resumed = train_drafter(target.cfg, target.params, train, held, tc, tmp_path / "a",
                            resume=True, progress=False)  # the checkpoint at step 1
    assert resumed.log["resumed_at"] == [1] and resumed.meta["complete"]


def test_keep_best_returns_the_best_evaluated_params_across_a_resume(target, cache, tmp_path,
                                                                   monkeypatch):
    """Held-out top-1 scripted to peak at step 4 of 12: the kept drafter is step 4's, also
    when the run stops at step 6 (evaluated there) and resumes."""
    import specjax.train.drafter as drafter_mod

    train, held = load_split(cache, "train"), load_split(cache, "heldout")
    tc = _tc(steps=12, checkpoint_every=2, eval_every=4, max_eval_tokens=64)
    top1 = iter([0.1, 0.5,             # run a: initial, step 4 (stops there)
                 0.1, 0.5, 0.3,        # run b: initial, 4, stopped at 6
                 0.4, 0.2,             # run b resumed: 8, final 12
                 0.1, 0.5, 0.4, 0.2])  # run c, without keep_best: 0, 4, 8, 12
    monkeypatch.setattr(drafter_mod, "evaluate",
                        lambda *a, **kw: evaluate(*a, **kw) | {"top1": next(top1)})
    at4 = train_drafter(target.cfg, target.params, train, held, tc, tmp_path / "a",
                        stop_after=4, progress=False)
    part = train_drafter(target.cfg, target.params, train, held, tc, tmp_path / "b",
                         stop_after=6, keep_best=True, progress=False)
    assert part.meta["kept"] == {"step": 4, "tag": "periodic", "top1": 0.5, "last_step": 6,
                                 "last_top1": 0.3}
    assert [r["tag"] for r in part.log["eval"]] == ["initial", "periodic", "stopped"]
    full = train_drafter(target.cfg, target.params, train, held, tc, tmp_path / "b",
                         resume=True, keep_best=True, progress=False)
    assert full.meta["complete"] and full.meta["steps"] == 12
    assert full.meta["kept"] == {"step": 4, "tag": "periodic", "top1": 0.5, "last_step": 12,
                                 "last_top1": 0.2}
    assert full.meta["heldout_top1"] == 0.5
    assert full.meta["tokens_seen"] == at4.meta["tokens_seen"]
    for res in (part, full):
        for a, b in zip(jax.tree.leaves(res.params), jax.tree.leaves(at4.params), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    last = train_drafter(target.cfg, target.params, train, held, tc, tmp_path / "c",
                         progress=False)
    assert last.meta["kept"] is None and last.meta["heldout_top1"] == 0.2
    assert next(top1, None) is None  # every scripted evaluation ran, and no other


def test_cli_end_to_end_on_pretokenised_data(target, tmp_path, capsys):
    rs = np.random.RandomState(0)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"tokens": rs.randint(0, 256, 24).tolist()}) + "\n"
                            for _ in range(12)))
    args = ["drafter", "--target", str(target.path), "--data", str(data), "--max-len", "24",
            "--heldout-fraction", "0.2", "--cache-dir", str(tmp_path / "c"), "--out",
            str(tmp_path / "d"), "--steps", "4", "--batch-size", "48", "--cache-batch-tokens",
            "48", "--checkpoint-every", "2", "--no-progress"]
    assert train_main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 4 and out["heldout_top1"] is not None
    _, _, meta = read_drafter(tmp_path / "d", target.cfg)
    assert meta["data"]["conversations"] == {"train": 9, "heldout": 3}
    assert train_main(args) == 2  # --out exists: a one-line error
    assert "--overwrite" in capsys.readouterr().err
    # --keep-best writes the best of the evaluations (initial and final here) and says which.
    again = args + ["--keep-best", "--overwrite", "--ckpt-dir", str(tmp_path / "ck2")]
    assert train_main(again) == 0
    kept = json.loads(capsys.readouterr().out)["kept"]
    assert kept["step"] in (0, 4) and kept["last_step"] == 4
    assert kept["top1"] == max(kept["top1"], kept["last_top1"])
    assert read_drafter(tmp_path / "d", target.cfg)[2]["kept"] == kept
    # A folder of the user's files is refused before anything is cached or trained, even
    # with --overwrite, and left as it was.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    bad = args[:args.index("--out") + 1] + [str(mine)] + args[args.index("--out") + 2:]
    bad[bad.index("--cache-dir") + 1] = str(tmp_path / "c2")
    assert train_main(bad + ["--overwrite"]) == 2
    assert "not a specjax folder" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "keep me" and not (tmp_path / "c2").exists()
    # --states-on-device: the states computed into this run's memory; no cache is written.
    dev = args[:args.index("--cache-dir") + 1] + [str(tmp_path / "c3")] + args[
        args.index("--cache-dir") + 2:] + ["--states-on-device", "--overwrite", "--ckpt-dir",
                                          str(tmp_path / "ck3")]
    assert train_main(dev) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 4
    assert not (tmp_path / "c3").exists()
    assert read_drafter(tmp_path / "d", target.cfg)[2]["data"]["cache_dir"] is None
    assert train_main(dev + ["--cache-only"]) == 2
    assert "cannot go with --cache-only" in capsys.readouterr().err


def test_fine_tuning_starts_from_the_given_drafter(target, cache, tmp_path):
    train, held = load_split(cache, "train"), load_split(cache, "heldout")
    first = train_drafter(target.cfg, target.params, train, held, _tc(steps=10),
                          tmp_path / "a", progress=False)
    src = write_drafter(tmp_path / "d1", first, {})
    tuned = train_drafter(target.cfg, target.params, train, held,
                          _tc(steps=5, init_from=str(src)), tmp_path / "b", progress=False)
    ev = {r["tag"]: r for r in first.log["eval"]}, {r["tag"]: r for r in tuned.log["eval"]}
    assert ev[1]["initial"]["loss"] == pytest.approx(ev[0]["final"]["loss"], rel=1e-5)
    assert ev[1]["initial"]["top1"] == ev[0]["final"]["top1"]
    # The learning curve counts the source's tokens too.
    assert tuned.meta["prior_tokens_seen"] == first.meta["tokens_seen"] > 0
    assert tuned.meta["tokens_seen_total"] == first.meta["tokens_seen"] + tuned.meta["tokens_seen"]
    assert [r["tokens_seen"] for r in tuned.log["eval"]][0] == 0

    # Grown to two layers: the added layer starts as the identity, so the run starts where
    # the one-layer drafter ended, and then trains it.
    grown = train_drafter(target.cfg, target.params, train, held,
                          _tc(steps=5, init_from=str(src), drafter_layers=2), tmp_path / "c",
                          progress=False)
    ev2 = {r["tag"]: r for r in grown.log["eval"]}
    assert ev2["initial"]["loss"] == pytest.approx(ev[0]["final"]["loss"], rel=1e-5)
    assert grown.cfg.num_layers == 2 and float(jnp.abs(grown.params.layers[1].wo).sum()) > 0
    deep = write_drafter(tmp_path / "d2", grown, {})
    assert read_drafter(deep, target.cfg)[0].num_layers == 2
    with pytest.raises(ValueError, match="has 2 decoder layers and this run trains 1; pass "
                                         "--drafter-layers 2"):
        train_drafter(target.cfg, target.params, train, held, _tc(steps=5, init_from=str(deep)),
                      tmp_path / "e", progress=False)
    # The CLI takes the starting drafter's depth unless told, and refuses fewer layers
    # before it caches anything.
    assert _drafter_layers(str(deep), None) == 2 and _drafter_layers(str(src), None) == 1
    assert _drafter_layers(None, None) == 1 and _drafter_layers(str(src), 3) == 3
    with pytest.raises(ValueError, match="has 2 decoder layers and this run trains 1"):
        _drafter_layers(str(deep), 1)


def test_cli_adds_extra_caches_and_refuses_another_targets(target, cache, tmp_path, capsys):
    rs = np.random.RandomState(1)
    caches = []
    for k in range(2):
        data = tmp_path / f"data{k}.jsonl"
        data.write_text("".join(json.dumps({"tokens": rs.randint(0, 256, 24).tolist()}) + "\n"
                                for _ in range(10)))
        caches.append(tmp_path / f"c{k}")
        assert train_main(["drafter", "--target", str(target.path), "--data", str(data),
                           "--max-len", "24", "--heldout-fraction", "0.2", "--cache-dir",
                           str(caches[-1]), "--out", str(tmp_path / "unused"),
                           "--cache-batch-tokens", "48", "--cache-only", "--no-progress"]) == 0
    base = ["drafter", "--target", str(target.path), "--data", str(tmp_path / "data0.jsonl"),
            "--max-len", "24", "--heldout-fraction", "0.2", "--cache-dir", str(caches[0]),
            "--cache-batch-tokens", "48", "--steps", "2", "--batch-size", "48", "--no-progress"]
    capsys.readouterr()
    assert train_main(base + ["--out", str(tmp_path / "one"), "--ckpt-dir",
                              str(tmp_path / "k1")]) == 0
    assert train_main(base + ["--out", str(tmp_path / "two"), "--ckpt-dir", str(tmp_path / "k2"),
                              "--extra-cache", str(caches[1])]) == 0
    logs = [json.loads((tmp_path / n / "training_log.json").read_text()) for n in ("one", "two")]
    rows = [lg["eval"][-1]["rows"] for lg in logs]
    assert rows[1] == 2 * rows[0] > 0  # both held-out splits are evaluated
    assert logs[1]["batches_per_epoch"] > logs[0]["batches_per_epoch"]
    assert logs[1]["meta"]["data"]["extra_caches"][0]["dir"] == str(caches[1])
    # `cache` holds the states of the in-memory target (scaled weights): another target.
    capsys.readouterr()
    assert train_main(base + ["--out", str(tmp_path / "three"), "--ckpt-dir",
                              str(tmp_path / "k3"), "--extra-cache", str(cache)]) == 2
    assert "another target" in capsys.readouterr().err


def test_scored_rows_pack_the_masked_rows_and_caps_cover_them():
    from specjax.train.drafter import score_cap, scored_rows

    x = jnp.arange(2 * 5 * 3, dtype=jnp.float32).reshape(2, 5, 3)
    mask = jnp.array([[0, 1, 1, 0, 0], [1, 0, 0, 0, 1]], bool)
    rows, valid = scored_rows(x, mask, 6)
    np.testing.assert_array_equal(np.asarray(valid), [1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(np.asarray(rows[:4]), np.asarray(x[mask]))
    for n_rows in (7, 128, 2048):
        for n in range(0, n_rows + 1, max(1, n_rows // 37)):
            cap = score_cap(n, n_rows)
            assert max(n, 1) <= cap <= n_rows
    assert len({score_cap(n, 2048) for n in range(2049)}) == 8  # few static shapes


def test_packed_loss_equals_the_unpacked_one(target, cache):
    """Scoring only the masked rows (cap) changes the cost, not the loss or its gradient."""
    from specjax.train.drafter import eagle_loss

    train = load_split(cache, "train")
    b = train.batch(32, list(range(4)), 4)
    model = init_drafter(target.cfg, target.params, _tc())
    graphdef, params = nnx.split(model, nnx.Param)
    args = (jnp.asarray(b["tokens"]), jnp.asarray(b["hidden"]), jnp.asarray(b["loss_mask"]))
    n = int(b["loss_mask"].sum())
    assert n < b["loss_mask"].size  # prompt rows exist, so packing is not trivial

    def f(p, cap):
        return eagle_loss(nnx.merge(graphdef, p), target.params.embed, target.params.head,
                          *args, None, 0.0, 0.5, cap)

    (l0, s0), g0 = jax.value_and_grad(f, has_aux=True)(params, None)
    (l1, s1), g1 = jax.value_and_grad(f, has_aux=True)(params, n + 3)
    np.testing.assert_allclose(float(l0), float(l1), rtol=1e-5)
    for k in s0:
        np.testing.assert_allclose(float(s0[k]), float(s1[k]), rtol=1e-5)
    for a, c in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-4, atol=1e-6)


def test_tv_term_is_the_sampled_rejection_probability(target, cache):
    """``accept`` is sum_x min(p, q) per scored row (the acceptance probability of a draft
    sampled at temperature 1), and --tv-weight w adds exactly w * (1 - accept) per row."""
    from specjax.train.drafter import eagle_loss, unrolled_features

    train = load_split(cache, "train")
    b = train.batch(32, list(range(4)), 4)
    model = init_drafter(target.cfg, target.params, _tc())
    graphdef, params = nnx.split(model, nnx.Param)
    tokens, hidden, mask = (jnp.asarray(b[k]) for k in ("tokens", "hidden", "loss_mask"))
    embed, head = target.params.embed, target.params.head

    def f(p, w):
        return eagle_loss(nnx.merge(graphdef, p), embed, head, tokens, hidden, mask, None,
                          0.0, 0.5, None, tv_weight=w)

    (l0, s0), (l1, s1) = f(params, 0.0), f(params, 2.0)
    n = float(s0["n"])
    assert float(s1["accept"]) == float(s0["accept"])  # a statistic, whatever the weight
    # The reference from the drafter's predicted features, in numpy.
    feats = jnp.pad(hidden[:, :-1], ((0, 0), (1, 0), (0, 0)))
    pred = np.asarray(unrolled_features(model, embed, tokens, feats, 1)[0], np.float64)
    softmax = lambda z: np.exp(z - z.max(-1, keepdims=True)) / np.exp(  # noqa: E731
        z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)
    w = np.asarray(head, np.float64)
    p_, q_ = softmax(np.asarray(hidden, np.float64) @ w.T), softmax(pred @ w.T)
    ref = (np.minimum(p_, q_).sum(-1) * np.asarray(mask)).sum()
    np.testing.assert_allclose(float(s0["accept"]), ref, rtol=1e-4)
    assert 0 < ref < n
    np.testing.assert_allclose(float(l1) - float(l0), 2.0 * (n - ref) / n, rtol=1e-3)
    g = jax.grad(lambda p: f(p, 1.0)[0] - f(p, 0.0)[0])(params)
    assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g)) > 0


def test_held_out_evaluation_reports_the_sampled_acceptance(target, cache, tmp_path):
    train, held = load_split(cache, "train"), load_split(cache, "heldout")
    res = train_drafter(target.cfg, target.params, train, held, _tc(tv_weight=1.0),
                        tmp_path / "ckpt", progress=False)
    ev = {r["tag"]: r for r in res.log["eval"]}
    assert 0 < ev["initial"]["accept"] < ev["final"]["accept"] < 1, ev
    assert res.meta["train_config"]["tv_weight"] == 1.0
    assert "tv_weight" not in _tc().to_json()  # older checkpoints resume unchanged


def test_shortlist_training_head_trains_and_evaluates_on_the_full_vocabulary(target, cache,
                                                                            tmp_path):
    train, held = load_split(cache, "train"), load_split(cache, "heldout")
    ids = np.arange(0, target.cfg.vocab_size, 2, dtype=np.int32)  # half the vocabulary
    with pytest.raises(ValueError, match="go together"):
        train_drafter(target.cfg, target.params, train, held, _tc(train_vocab="fr:128"),
                      tmp_path / "x", progress=False)
    res = train_drafter(target.cfg, target.params, train, held, _tc(train_vocab="fr:128"),
                        tmp_path / "ckpt", train_ids=ids, progress=False)
    ev = {r["tag"]: r for r in res.log["eval"]}
    assert ev["final"]["loss"] < 0.7 * ev["initial"]["loss"], ev
    assert res.meta["train_config"]["train_vocab"] == "fr:128"


def test_unrolled_steps_equal_a_drafted_chain(target, cache):
    """Training-time test: step k of the unroll computes exactly what the drafter computes
    for the k-th node of a chain at inference (the context rows from the target's features,
    then its own predicted features), for every chain start in the sequence."""
    from specjax.drafter import drafter_hidden, init_drafter_cache
    from specjax.train.drafter import unrolled_features

    train = load_split(cache, "train")
    b = train.batch(32, [0], 1)
    tokens, hidden = jnp.asarray(b["tokens"]), jnp.asarray(b["hidden"])
    model = init_drafter(target.cfg, target.params, _tc(init="random"))
    feats = jnp.pad(hidden[:, :-1], ((0, 0), (1, 0), (0, 0)))
    preds = unrolled_features(model, target.params.embed, tokens, feats, 3)
    dp, cfg, embed = model.params(), model.cfg, target.params.embed
    for start in (0, 1, 5, 17):  # the chain's first token is x_start
        # Context pass (rows 0..start with the target's features), as the engine's catch-up.
        c = init_drafter_cache(cfg, 1, 64)
        pos = jnp.arange(start + 1)[None]
        h, c = drafter_hidden(dp, cfg, embed, tokens[:, :start + 1], feats[:, :start + 1], pos,
                              c)
        c = dataclasses.replace(c, lengths=c.lengths + start + 1)
        np.testing.assert_allclose(np.asarray(h[0, start]), np.asarray(preds[0][0, start]),
                                   rtol=2e-4, atol=2e-5)
        prev = h[:, start:start + 1]
        for k in (2, 3):  # chain node k reads x_{start+k-1} and the node before's prediction
            p = start + k - 1
            h, c = drafter_hidden(dp, cfg, embed, tokens[:, p:p + 1], prev, jnp.array([[p]]), c)
            c = dataclasses.replace(c, lengths=c.lengths + 1)
            np.testing.assert_allclose(np.asarray(h[0, 0]), np.asarray(preds[k - 1][0, p]),
                                       rtol=2e-4, atol=2e-5)
            prev = h


def test_training_time_test_trains_every_step(target, cache, tmp_path):
    train, held = load_split(cache, "train"), load_split(cache, "heldout")
    res = train_drafter(target.cfg, target.params, train, held, _tc(ttt_steps=3, ttt_decay=0.8),
                        tmp_path / "ckpt", progress=False)
    ev = {r["tag"]: r for r in res.log["eval"]}
    assert ev["final"]["loss"] < 0.6 * ev["initial"]["loss"], ev
    for k in ("top1_2", "top1_3"):
        assert ev["final"][k] > ev["initial"][k], ev
    assert "top1_3" in res.log["train"][-1]
    with pytest.raises(ValueError, match="ttt_steps"):
        train_drafter(target.cfg, target.params, train, held, _tc(ttt_steps=0),
                      tmp_path / "bad", progress=False)


def test_last_layer_init_of_a_sandwich_norm_target_is_the_identity_with_a_smooth_gradient(
        tmp_path):
    """Gemma 3 normalises each branch's output (sandwich norms), so zeroing ``wo`` / ``w_down``
    would put the untrained layer on RMSNorm(0), whose gradient is 1/sqrt(eps): the post-norm
    scales are zeroed instead. The layer starts as the identity either way; here its
    gradient stays of the order of the inputs'."""
    from specjax.drafter import drafter_hidden, init_drafter_cache

    src = make_hf_checkpoint(tmp_path / "hf", "gemma3")
    t = specjax.load(specjax.convert(src, tmp_path / "sj", progress=False))
    model = init_drafter(t.cfg, t.params, _tc())
    layer = model.params().layers[0]
    assert not np.any(np.asarray(layer.post_attn_norm))
    assert not np.any(np.asarray(layer.post_mlp_norm))
    assert np.any(np.asarray(layer.wo)) and np.any(np.asarray(layer.w_down))  # pretrained
    cfg, n = model.cfg, 12
    rs = np.random.RandomState(0)
    tokens = jnp.asarray(rs.randint(0, t.cfg.vocab_size, (1, n)), jnp.int32)
    feats = jnp.asarray(rs.normal(size=(1, n, t.cfg.hidden_size)), jnp.float32)
    pos = jnp.arange(n)[None]

    def out(dp):
        h, _ = drafter_hidden(dp, cfg, t.params.embed, tokens, feats, pos,
                              init_drafter_cache(cfg, 1, n))
        return h

    dp = model.params()
    x = jnp.concatenate([t.params.embed[tokens], feats], axis=-1) @ dp.fc + dp.fc_bias
    np.testing.assert_allclose(out(dp), x, rtol=1e-6, atol=1e-6)  # the identity
    g = jax.grad(lambda d: jnp.mean(out(d) ** 2))(dp)
    scale = float(jnp.sqrt(jnp.mean(x ** 2)))
    for name in ("wo", "w_down", "post_attn_norm", "post_mlp_norm"):
        gn = float(jnp.linalg.norm(getattr(g.layers[0], name)))
        assert np.isfinite(gn) and gn < 100 * scale, (name, gn, scale)


def test_tapped_cache_stores_the_layers_and_a_tapped_run_grows_from_an_untapped_drafter(
        target, cache, tmp_path):
    """Taps (DrafterConfig.taps): the cache stores the tapped layers' outputs, a tapped run
    started from an untapped drafter begins exactly where it ended (zero tap weight) and then
    trains the taps, and mismatched caches and drafters are refused by name."""
    ex = sequences()
    tapped = tmp_path / "tapped"
    kw = dict(heldout_fraction=0.2, token_budget=128, batches_per_shard=2,
              hidden_dtype="float32", progress=False)
    manifest = cache_hidden_states(target.cfg, target.params, ex, tapped, taps=(0,), **kw)
    assert manifest["taps"] == [0]
    train, held = load_split(tapped, "train"), load_split(tapped, "heldout")
    assert train.tap_layers == (0,) and train.taps.shape == train.hidden.shape[:1] + (1, 64)
    np.testing.assert_array_equal(train.hidden, load_split(cache, "train").hidden)
    i = 0
    o, n = int(train.offsets[i]), int(train.lengths[i])
    toks = jnp.asarray(ex[int(train.index[i])].tokens)[None]
    _, _, (layer0,) = forward_hidden(target.params, target.cfg, toks, jnp.arange(n)[None],
                                     init_cache(target.cfg, 1, n), tap_layers=(0,))
    np.testing.assert_allclose(train.taps[o:o + n, 0], np.asarray(layer0[0]), atol=2e-5,
                               rtol=2e-5)
    assert train.batch(32, [0, 1], 3)["taps"].shape == (3, 32, 1, 64)
    with pytest.raises(ValueError, match=r"taps \[0\], and this run needs taps \[1\]"):
        cache_hidden_states(target.cfg, target.params, ex, tapped, taps=(1,), **kw)

    plain_train, plain_held = load_split(cache, "train"), load_split(cache, "heldout")
    first = train_drafter(target.cfg, target.params, plain_train, plain_held, _tc(steps=10),
                          tmp_path / "a", progress=False)
    src = write_drafter(tmp_path / "d1", first, {})
    grown = train_drafter(target.cfg, target.params, train, held,
                          _tc(steps=5, init_from=str(src), drafter_taps=(0,)), tmp_path / "b",
                          progress=False)
    ev, ev_src = ({r["tag"]: r for r in res.log["eval"]} for res in (grown, first))
    assert ev["initial"]["loss"] == pytest.approx(ev_src["final"]["loss"], rel=1e-5)
    assert grown.cfg.taps == (0,) and float(jnp.abs(grown.params.tap_fc).sum()) > 0
    out = write_drafter(tmp_path / "d2", grown, {})
    assert read_drafter(out, target.cfg)[0].taps == (0,)
    assert grown.log["train_config"]["drafter_taps"] == [0]
    assert "drafter_taps" not in first.log["train_config"]  # older logs resume unchanged
    with pytest.raises(ValueError, match=r"reads target layers \[0\] but the hidden-state "
                                         r"cache stores \[\]"):
        train_drafter(target.cfg, target.params, plain_train, plain_held,
                      _tc(steps=5, drafter_taps=(0,)), tmp_path / "c", progress=False)
    with pytest.raises(ValueError, match=r"pass --drafter-taps 0 to start from it"):
        train_drafter(target.cfg, target.params, train, held, _tc(steps=5, init_from=str(out)),
                      tmp_path / "e", progress=False)
    for bad in ("2,1", "a", "-1"):
        with pytest.raises(SystemExit):
            train_main(["drafter", "--data", "x", "--drafter-taps", bad])


def test_on_device_batches_gather_the_same_rows_and_train_the_same_drafter(target, tmp_path):
    """--on-device: the split lives in accelerator memory, each batch is gathered there, and
    every row is scored (no packing): the same batches, the same steps up to summation order,
    with taps, and with buckets as wide as asked."""
    d = tmp_path / "tapped"
    cache_hidden_states(target.cfg, target.params, sequences(), d, heldout_fraction=0.2,
                        token_budget=128, batches_per_shard=2, hidden_dtype="float16",
                        taps=(0,), progress=False)
    train, held = load_split(d, "train"), load_split(d, "heldout")
    host = train.batch(32, [2, 0], 3)
    dev = train.batch(32, [2, 0], 3, features=False)
    assert set(dev) == {"tokens", "loss_mask", "index", "valid"}
    for k in ("tokens", "loss_mask"):
        np.testing.assert_array_equal(dev[k], host[k])
    for k, flat in (("hidden", train.hidden), ("taps", train.taps)):
        got = gather_rows(jnp.asarray(flat), jnp.asarray(dev["index"]), jnp.asarray(dev["valid"]))
        np.testing.assert_array_equal(np.asarray(got), host[k])
    tc = _tc(steps=6, drafter_taps=(0,))
    a = train_drafter(target.cfg, target.params, train, held, tc, tmp_path / "a",
                      progress=False)
    b = train_drafter(target.cfg, target.params, train, held, tc, tmp_path / "b",
                      progress=False, on_device=True, log_every=3, bucket_width=256)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)
    assert [r["step"] for r in b.log["train"]] == [3, 6]
    assert training_buckets(np.array([100, 1200]), 304) == (304, 608, 912, 1200)


def test_states_computed_on_device_equal_the_cache_and_train_the_same_drafter(target,
                                                                             tmp_path,
                                                                             monkeypatch):
    """device_hidden_states (--states-on-device): the cache's splits, in its order, the train
    split's states never leaving the device and the held-out split on the host; training on
    them takes the cache's steps."""
    kw = dict(heldout_fraction=0.2, token_budget=128, hidden_dtype="float16", taps=(0,))
    ex = sequences()
    manifest, train, held = device_hidden_states(target.cfg, target.params, ex,
                                                 progress=False, **kw)
    disk = cache_hidden_states(target.cfg, target.params, ex, tmp_path / "c",
                               batches_per_shard=16, progress=False, **kw)
    assert manifest["plan_hash"] == disk["plan_hash"] and manifest["complete"]
    assert manifest["splits"] == disk["splits"] and manifest["seconds"]["total"] > 0
    assert isinstance(train.hidden, jax.Array) and isinstance(train.taps, jax.Array)
    assert isinstance(held.hidden, np.ndarray) and isinstance(held.taps, np.ndarray)
    for got, split in ((train, "train"), (held, "heldout")):
        want = load_split(tmp_path / "c", split)
        for f in ("tokens", "assistant", "lengths", "offsets", "index"):
            np.testing.assert_array_equal(getattr(got, f), getattr(want, f))
        for f in ("hidden", "taps"):  # the same compiled forward: the same fp16 states
            assert np.asarray(getattr(got, f)).dtype == np.float16
            np.testing.assert_array_equal(np.asarray(getattr(got, f)), getattr(want, f))
        assert got.tap_layers == (0,)
    tc = _tc(steps=4, drafter_taps=(0,))
    a = train_drafter(target.cfg, target.params, load_split(tmp_path / "c", "train"),
                      load_split(tmp_path / "c", "heldout"), tc, tmp_path / "a",
                      progress=False, on_device=True)
    b = train_drafter(target.cfg, target.params, train, held, tc, tmp_path / "b",
                      progress=False, on_device=True)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    import tqdm.auto

    class Bar:  # the progress bar's updates, recorded
        made: list[Bar] = []

        def __init__(self, total, **_):
            self.total, self.updates = total, []
            Bar.made.append(self)

        def update(self, n):
            self.updates.append(n)

        def close(self):
            pass

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    assert device_hidden_states(target.cfg, target.params, ex, progress=True,
                                **{**kw, "taps": ()})[1].taps is None
    (bar,) = Bar.made  # one update a batch, each batch's real tokens, all of them in the end
    assert sum(bar.updates) == bar.total == sum(len(e.tokens) for e in ex)
    assert len(bar.updates) > 2 and min(bar.updates) > 0


def test_tap_lr_scale_scales_the_tap_weights_updates_only(target):
    from specjax.train.drafter import make_optimizer

    model = init_drafter(target.cfg, target.params, _tc(drafter_taps=(0,)))
    _, params = nnx.split(model, nnx.Param)
    grads = jax.tree.map(jnp.ones_like, params)
    ups = []
    for k in (1.0, 10.0):
        tx = make_optimizer(_tc(tap_lr_scale=k), 30)
        state = tx.init(params)
        for _ in range(2):  # the warm-up's first step has lr 0
            up, state = tx.update(grads, state, params)
        ups.append(up)
    assert float(jnp.abs(ups[0]["tap_fc"][...]).min()) > 0
    for path, a in jax.tree_util.tree_leaves_with_path(ups[0]):
        b = dict(jax.tree_util.tree_leaves_with_path(ups[1]))[path]
        k = 10.0 if "tap_fc" in jax.tree_util.keystr(path) else 1.0
        np.testing.assert_allclose(np.asarray(b), k * np.asarray(a), rtol=1e-6)
    assert _tc(tap_lr_scale=10.0).to_json()["tap_lr_scale"] == 10.0
    assert "tap_lr_scale" not in _tc().to_json()


