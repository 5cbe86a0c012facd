"""The mesh cases of ``tests/spmd/test_mesh.py``, run in a child process with 8 CPU devices.

``python -m tests.spmd.mesh_cases TARGET DRAFTER OUT.json``: loads the tiny target and its
fitted drafter, decodes the same prompts on one device and on every mesh, and writes what
the parent asserts (tokens per case, the sharding of every parameter and loop-state array,
per-device parameter bytes) as JSON. It asserts nothing itself, so a failure is reported
by the parent test that owns the property.

Why a child process: the device count is fixed when jax starts
(``--xla_force_host_platform_device_count``), and the rest of the suite must keep running
on one device. One child runs every case, so jax starts and the tiny models load once;
it compiles 11 decode loops and takes about 3.5 minutes on a shared 2-core machine
(the 1x8 and 2x2 speculative loops most: 30-40 s each).
Importing this module (the parent does, for :data:`MESH_HEADS`) imports no jax.
"""

from __future__ import annotations

import json
import os
import sys
import time

# Three prompts: on a data axis of 2 the batch is padded to 4 and the padding dropped.
# Every mesh runs vanilla and EAGLE-2 speculative decoding, each with one vocabulary head
# (compiling the loop per mesh and head is what costs time, so the heads are spread over
# the meshes rather than crossed with them); 2x2 also runs the full head.
MESH_HEADS = {"data=1,model=1": ["full"], "data=2": ["evospec"], "model=2": ["pafr"],
              "data=2,model=2": ["full", "dynaspec"], "model=8": ["fr"]}
# The whole cross product (``... OUT.json cross``): every head on every mesh, 25 speculative
# loops (about 15 minutes here), run by the benchmark suite, not by CI.
ALL_HEADS = ["full", "fr", "pafr", "dynaspec", "evospec"]
# Cases that also route the tree blocks through kernels/tree_attention.py (its XLA path,
# under shard_map by rows and KV heads) instead of the inline dense softmax.
TREE_ATTENTION = {("data=2,model=2", "dynaspec"), ("model=2", "pafr")}
INSPECTED = ("data=2,model=2", "model=8")  # meshes whose placements are recorded
TREE = dict(kind="eagle2", depth=3, top_k=2, total_tokens=6)
NEW = 16


def heads(target) -> dict:
    """One head of each kind: tests/vocab/test_heads.py's, FR cut to 64 rows (8 per device
    on model=8), and an EvoSpec head."""
    import numpy as np

    from specjax.vocab.evospec import evospec_head
    from tests.vocab.test_heads import example_heads

    w = target.params.head
    v = w.shape[0]
    made = example_heads(w, fr_rows=v // 4)
    return {"fr": made["fr"], "pafr": made["pafr"], "dynaspec": made["dynaspec-pa"],
            "evospec": evospec_head(w, np.arange(v), [0], v // 8, n_dyn=v // 8)}


def specs(tree) -> dict[str, list]:
    """{path: PartitionSpec as a list} for every leaf (None for replicated dimensions)."""
    import jax

    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): list(x.sharding.spec) for p, x in flat}


def main(target_dir: str, drafter_dir: str, out: str, cross: str = "") -> None:
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py

    import specjax
    from specjax import sharding as sh
    from specjax.api import _pad_rows, _plan, _runner_on_mesh
    from specjax.compile_cache import ENV, enable_compilation_cache
    from specjax.speculative import TreeSpec
    from tests.speculative.conftest import PROMPTS

    if os.environ.get(ENV):  # set by tests/conftest.py: a bare run never writes ~/.cache
        enable_compilation_cache()

    tree = TreeSpec(**TREE)
    res: dict = {"devices": jax.device_count(), "cases": {}, "seconds": {}}
    single = specjax.load(target_dir)
    drafter = specjax.load_drafter(drafter_dir, single)
    kw = dict(max_new_tokens=NEW, stop_on_eos=False)
    res["reference"] = specjax.generate(single, PROMPTS, **kw).tokens

    def run(name, target, mesh, **more):
        t = time.perf_counter()
        r = specjax.generate(target, PROMPTS, mesh=mesh, **kw, **more)
        res["cases"][name] = r.tokens
        res["seconds"][name] = round(time.perf_counter() - t, 1)
        return r

    made = heads(single)
    plan = {m: ALL_HEADS for m in MESH_HEADS} if cross == "cross" else MESH_HEADS
    for mesh, names in plan.items():
        # The widest mesh loads straight into its shardings (orbax); the others place a
        # single-device load on the mesh inside generate.
        target = specjax.load(target_dir, mesh=mesh) if mesh == "model=8" else single
        run(f"vanilla {mesh}", target, mesh)
        for name in names:
            run(f"eagle2 {mesh} {name}", target, mesh, drafter=drafter, tree=tree,
                vocab=made.get(name, "full"),
                attention="xla" if (mesh, name) in TREE_ATTENTION else "dense")

    # Where everything lives on the 2x2 and 1x8 meshes.
    for mesh_text in INSPECTED:
        mesh = sh.as_mesh(mesh_text)
        target = specjax.load(target_dir, mesh=mesh)
        dparams = sh.shard_params(drafter.params, mesh)
        placed = {name: sh.shard_head(h, mesh) for name, h in heads(target).items()}
        # The requests of the runs above: the prefill program is already compiled.
        runner, req = _plan(target, _pad_rows(PROMPTS, mesh), max_new_tokens=NEW,
                            temperature=0.0, top_k=0, top_p=1.0, seed=0, key=None,
                            stop_on_eos=False,
                            drafter=specjax.Drafter(drafter.cfg, dparams), tree=tree,
                            assume_q_one=False, vocab="full")
        runner, req = _runner_on_mesh(runner, req, 3, mesh)
        with sh.use_mesh(mesh):
            state = runner.prefill(req)
        res[mesh_text] = {
            "target": specs(target.params), "drafter": specs(dparams),
            "heads": {n: specs(h) for n, h in placed.items()}, "state": specs(state),
            "bytes_per_device": sh.per_device_bytes(target.params),
            "bytes_total": sh.total_bytes(target.params),
            "head_bytes_per_device": sh.per_device_bytes(target.params.head),
            "head_bytes_total": sh.total_bytes(target.params.head),
            "state_fallbacks": sh.fallbacks(state, mesh, sh.state_axes)}
    try:
        sh.as_mesh("data=4,model=4")
    except ValueError as e:
        res["too_many_devices"] = str(e)
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    # Before jax starts: 8 simulated CPU devices.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    main(*sys.argv[1:5])
