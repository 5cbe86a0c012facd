"""SPMD on 8 simulated CPU devices: greedy tokens equal the single-device run on every mesh,
and every parameter, head matrix and loop-state array sits where the rules put it.

The meshes run in one child process (``tests/spmd/mesh_cases.py``, see its docstring for
why), started by the module fixture below, so the default ``pytest`` run (CI) collects
and runs them while the rest of the suite keeps its single device. The mesh-free pieces
(parsing, the rules, refusals) are tested here in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from specjax import sharding as sh
from specjax.drafter import save_drafter
from tests.spmd.mesh_cases import ALL_HEADS, INSPECTED, MESH_HEADS

ROOT = Path(__file__).resolve().parents[2]

# The tiny Llama (V=256, d=64, Hq*Dh=64, Hkv*Dh=32, F=96) divides by 2 and 8 everywhere,
# so every matrix must be split; written out here, not derived from sharding.RULES, so a
# rule that silently stops splitting fails.
SPLIT = {"embed": ["model"], "lm_head": ["model"], "wq": [None, "model"],
         "wk": [None, "model"], "wv": [None, "model"], "wo": ["model"],
         "w_gate": [None, "model"], "w_up": [None, "model"], "w_down": ["model"],
         "fc": ["model"], "attn_norm": [], "mlp_norm": [], "final_norm": [], "fc_bias": []}


def _child(target, drafter, d: Path, *extra: str) -> dict:
    """Run ``tests.spmd.mesh_cases`` in a child with 8 CPU devices; its JSON results."""
    save_drafter(d / "drafter", drafter.cfg, drafter.params)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.spmd.mesh_cases", str(target.path),
         str(d / "drafter"), str(d / "out.json"), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((d / "out.json").read_text())


@pytest.fixture(scope="module")
def mesh_run(tiny_target, fitted_drafter, tmp_path_factory):
    return _child(tiny_target, fitted_drafter, tmp_path_factory.mktemp("spmd"))


@pytest.mark.bench
def test_every_head_on_every_mesh(tiny_target, fitted_drafter, tmp_path):
    """The cross product CI samples: every vocabulary head with EAGLE-2 on every mesh."""
    run = _child(tiny_target, fitted_drafter, tmp_path, "cross")
    want = [f"eagle2 {m} {h}" for m in MESH_HEADS for h in ALL_HEADS]
    assert sorted(c for c in run["cases"] if c.startswith("eagle2")) == sorted(want)
    for case, tokens in run["cases"].items():
        assert tokens == run["reference"], case


def _field(path: str) -> str:
    return path.rsplit(".", 1)[-1].split("[")[0]


def test_the_child_sees_eight_devices(mesh_run):
    assert mesh_run["devices"] == 8


CASES = [f"vanilla {m}" for m in MESH_HEADS] + [
    f"eagle2 {m} {h}" for m, hs in MESH_HEADS.items() for h in hs]


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_the_single_device_run(mesh_run, case):
    ref = mesh_run["reference"]
    assert len(ref) == 3 and all(len(t) == 16 for t in ref)  # 3 rows: padded on data=2
    assert mesh_run["cases"][case] == ref


@pytest.mark.parametrize("mesh", INSPECTED)
def test_every_target_and_drafter_matrix_is_split(mesh_run, mesh):
    for what in ("target", "drafter"):
        placed = mesh_run[mesh][what]
        assert placed, what
        for path, got in placed.items():
            assert got == SPLIT[_field(path)], (what, path, got)


@pytest.mark.parametrize("mesh", INSPECTED)
def test_head_rows_are_split_over_the_vocabulary(mesh_run, mesh):
    h = mesh_run[mesh]["heads"]
    assert h["fr"][".w_blocks[0]"] == ["model"]
    assert h["evospec"][".core_w"] == ["model"]
    # Index tables and the DynaSpec router are replicated on purpose (read whole).
    assert all(s == [] for s in h["dynaspec"].values())
    assert h["evospec"][".core_ids"] == [] and h["evospec"][".successors"] == []
    # PA-FR's budget blocks (42, 32, 25, ... rows) are re-cut at multiples of the model
    # axis, so every one of them splits.
    blocks = [s for p, s in h["pafr"].items() if p.startswith(".w_blocks")]
    assert len(blocks) > 1 and all(s == ["model"] for s in blocks), h["pafr"]


def test_loop_state_is_split_by_rows_and_kv_heads(mesh_run):
    st = mesh_run["data=2,model=2"]["state"]
    for path, got in st.items():
        if _field(path) in ("k", "v"):
            assert got == ["data", None, "model"], path
        elif _field(path) in ("key", "eos_ids", "temperature", "top_p"):
            assert got == [], path
        else:
            assert got == ["data"], path  # every other loop-state array is per row
    assert mesh_run["data=2,model=2"]["state_fallbacks"] == []
    # 2 KV heads on model=8: the cache is replicated, and reported as such.
    st8 = mesh_run["model=8"]
    assert st8["state"][".tcache.k[0]"] == []
    assert ".tcache.k[0]" in st8["state_fallbacks"]


@pytest.mark.parametrize("mesh,m", [("data=2,model=2", 2), ("model=8", 8)])
def test_per_device_parameter_bytes_fall_as_one_over_the_model_axis(mesh_run, mesh, m):
    r = mesh_run[mesh]
    per, total = r["bytes_per_device"], r["bytes_total"]
    assert len(per) == (4 if m == 2 else 8)
    assert all(abs(b / (total / m) - 1) <= 0.05 for b in per.values()), (per, total)
    assert all(b == r["head_bytes_total"] / m for b in r["head_bytes_per_device"].values())


def test_a_mesh_larger_than_the_devices_is_refused(mesh_run):
    assert "needs 16 devices, jax sees 8" in mesh_run["too_many_devices"]
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
        sh.make_mesh(2, 1)  # this process has one CPU device


# --- in-process: no mesh needed ---

def test_parse_mesh():
    assert sh.parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
    assert sh.parse_mesh("model=8") == {"data": 1, "model": 8}
    for bad, msg in (("data=2,pipe=2", "unknown axis 'pipe'"), ("data=0", "must be >= 1"),
                     ("data=2,data=2", "given twice"), ("data:2", "not AXIS=SIZE"),
                     ("", "must look like")):
        with pytest.raises(ValueError, match=msg):
            sh.parse_mesh(bad)


def test_a_mesh_of_other_axes_is_refused():
    dev = jax.devices()[:1]
    with pytest.raises(ValueError, match="mesh axes must be"):
        sh.as_mesh(jax.make_mesh((1, 1), ("batch", "tp"), devices=dev))
    explicit = jax.make_mesh((1, 1), sh.MESH_AXES, devices=dev,
                             axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with pytest.raises(ValueError, match="AxisType.Auto"):
        sh.as_mesh(explicit)
    with pytest.raises(TypeError, match="mesh must be"):
        sh.as_mesh(8)


def test_recut_frequency_blocks_score_the_same_candidates():
    import numpy as np

    from specjax.vocab.fr_head import frequency_head

    rs = np.random.RandomState(0)
    w = jnp.asarray(rs.randn(300, 16).astype(np.float32))
    h = jnp.asarray(rs.randn(2, 3, 16).astype(np.float32))
    head = frequency_head(w, rs.permutation(300), [0], k_max=256, position_aware=True)
    for m in (2, 8):
        recut = head.split_rows(m)
        assert all(b.shape[0] % m == 0 for b in recut.w_blocks), [b.shape for b in recut.w_blocks]
        for step in range(6):
            a, b = head(w, h, step), recut(w, h, step)
            assert (a.ids == b.ids).all()
            np.testing.assert_allclose(a.logits, b.logits, rtol=1e-6, atol=1e-6)


def test_a_dimension_the_mesh_axis_does_not_divide_is_replicated():
    mesh = jax.sharding.AbstractMesh((2, 4), sh.MESH_AXES)
    assert sh.spec(("batch", "seq", "kv_heads", "head_dim"), (4, 32, 3, 64), mesh) == P("data")
    assert sh.spec(("batch", "seq", "kv_heads", "head_dim"), (4, 32, 8, 64), mesh) == P(
        "data", None, "model")
    assert sh.spec(("vocab", "embed"), (49152, 576), mesh) == P("model")


def test_without_a_mesh_constraints_are_the_identity():
    x = jnp.ones((2, 8))
    assert sh.active_mesh() is None
    assert sh.constrain(x, ("batch", "vocab")) is x


def test_every_parameter_field_has_a_rule(tiny_target, fitted_drafter):
    from specjax.model import unfuse_params

    for tree in (tiny_target.params, unfuse_params(tiny_target.params), fitted_drafter.params):
        jax.tree_util.tree_map_with_path(sh.param_axes, tree)  # KeyError names a new field


@pytest.mark.parametrize("args,message", [
    (["--mesh", "data=2,model=4"], "needs 8 devices, jax sees 1"),
    (["--mesh", "data=2,tensor=4"], "unknown axis 'tensor'"),
    (["--mesh", "model=2", "--stream"], "--stream runs on one device"),
    (["--num-processes", "2"], "needs all of coordinator address"),
    (["--coordinator-address", "nohost", "--num-processes", "2", "--process-id", "0"],
     "HOST:PORT"),
    (["--coordinator-address", "h:1", "--num-processes", "2", "--process-id", "2"],
     r"process_id must be in \[0, 2\)"),
])
def test_generate_refuses_bad_mesh_flags_before_loading(tmp_path, capsys, args, message):
    from specjax.cli import main

    # The model folder does not exist: each refusal must come before the load.
    assert main(["generate", "--model", str(tmp_path / "none"), "--prompt", "hi",
                 *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and __import__("re").search(message, err), err
