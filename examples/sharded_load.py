"""Peak host memory and per-device parameter bytes of loading the default target on a mesh.

Each way of loading runs in a fresh process (peak RSS only grows), on simulated CPU
devices::

    python examples/sharded_load.py                    # every way below, one JSON line each
    python examples/sharded_load.py --one plain        # one of them

Ways: ``plain`` (one device, no mesh), ``restore model=M`` (orbax restores each tensor
into its ``model=M`` sharding), ``place model=M`` (a plain load, then placed on the
mesh: the host holds the whole model first), ``replicated data=8`` (every device a whole
copy). On simulated CPU devices every device's memory *is* host memory, so the peak RSS
counts all devices' shards: a sharded restore should cost one copy of the model, a
replicated one eight.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

WAYS = ["plain", "restore model=8", "restore model=4", "place model=8", "replicated data=8"]


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def one(way: str) -> dict:
    if way != "plain":
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    import specjax
    from specjax import sharding as sh
    from specjax.defaults import ensure_default_target
    from specjax.tokenizer import load_tokenizer

    path = ensure_default_target()
    # The baseline after what load() does besides the tensors: the jax runtime up and the
    # tokenizer loaded (importing transformers costs ~0.2-0.3 GB of its own).
    jax.numpy.zeros(1).block_until_ready()
    load_tokenizer(path)
    before = _rss_mb()
    kind, _, mesh = way.partition(" ")
    if kind == "restore":
        target = specjax.load(path, mesh=mesh)
    else:
        target = specjax.load(path)
        if mesh:
            target = dataclasses.replace(
                target, params=sh.shard_params(target.params, sh.as_mesh(mesh)))
    jax.block_until_ready(target.params)
    per = sh.per_device_bytes(target.params)
    head = sh.per_device_bytes(target.params.head)
    m = sh.parse_mesh(mesh)["model"] if mesh else 1
    total, head_total = sh.total_bytes(target.params), sh.total_bytes(target.params.head)
    return {"way": way, "devices": jax.device_count(), "peak_rss_mb": round(_rss_mb(), 1),
            "rss_before_load_mb": round(before, 1),
            "load_peak_mb": round(_rss_mb() - before, 1),
            "params_mb": round(total / 2**20, 1),
            "max_per_device_mb": round(max(per.values()) / 2**20, 2),
            "per_device_over_total_per_m": round(max(per.values()) / (total / m), 4),
            "head_per_device_over_total_per_m": round(max(head.values()) / (head_total / m), 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", choices=WAYS, default=None)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return 0
    for way in WAYS:
        out = subprocess.run([sys.executable, __file__, "--one", way], capture_output=True,
                             text=True, check=True).stdout
        print(out.strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
