"""The one place for what differs between the jax lines specjax supports (0.10.2 - 0.11.x).

Everything version- or backend-dependent that the kernels and tests touch goes through
here, so a jax upgrade that moves an API changes this file and nothing else:

* the Pallas Triton module (``load``/``store``/``dot`` with masks) and its compiler params;
* whether compiled Pallas GPU kernels can run here (a GPU backend), which picks the
  kernels' default implementation;
* lowering a function for CUDA on any jaxlib, which the CPU suite uses to catch GPU-only
  lowering errors without a GPU;
* run from a source checkout, the Hugging Face ``kernels`` package that transformers >= 5.25
  imports, which the checkout's top-level ``kernels/`` folder would otherwise shadow
  (:func:`keep_hub_kernels_importable`).

Checked on jax 0.10.2 (this machine's lock) and 0.11.2 (under Python 3.12), both on CPU:
no GPU has run these paths yet.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from jax.experimental.pallas import triton as pltriton  # the kernels import it from here


def triton_params(*, num_warps: int, num_stages: int) -> Any:
    """Compiler params for a Pallas kernel lowered through Triton."""
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pallas_gpu_available() -> bool:
    """True when the default backend is a GPU, so compiled Triton kernels can run."""
    return jax.default_backend() == "gpu"


# The GPU a CUDA lowering targets when this process has none: jax 0.11's Triton lowering
# asks the device for its compute capability, so a CPU-only process names one through an
# abstract mesh (jax 0.10.2's lowering does not ask, and lowers the same under it).
ABSTRACT_GPU = "NVIDIA H100"


def lower_for_cuda(fn: Callable, *args: Any, device_kind: str = ABSTRACT_GPU) -> Any:
    """``jax.jit(fn)`` lowered for CUDA from abstract ``args`` (``jax.ShapeDtypeStruct``s),
    on any jaxlib: a CPU-only install lowers Pallas/Triton kernels to their Triton IR
    without a GPU, which is where GPU-only errors (block shapes, dtypes) show up."""
    gpu = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("_gpu",), abstract_device=gpu)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


# The repository root when specjax runs from a source checkout (an editable install, or the
# tests): its top-level kernels/ folder is installed as specjax.kernels, but the root itself
# is on sys.path whenever Python starts there (``python -m ...``, pytest's rootdir).
_CHECKOUT = Path(__file__).resolve().parent.parent


class _KernelsBesideTheCheckout(importlib.abc.MetaPathFinder):
    """Finds a top-level ``kernels`` module on ``sys.path`` without the checkout's root.

    transformers >= 5.25 depends on the Hugging Face ``kernels`` package and imports it with
    its activations, so ``import kernels`` must not find this repository's folder (it has no
    ``CUDAProperties``, and the tokenizer then fails to load). Where no such package is
    installed this finds nothing and the usual finders run, as before."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "kernels" or path is not None:
            return None
        # _CHECKOUT is resolved already; sys.path entries may be relative ("" is the cwd).
        rest = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != str(_CHECKOUT)]
        return importlib.machinery.PathFinder.find_spec(name, rest)


def keep_hub_kernels_importable() -> None:
    """In a source checkout, make ``import kernels`` skip the checkout's own ``kernels/``.

    Called first thing by ``import specjax``; a no-op for an installed wheel (whose kernels
    live at ``specjax/kernels``), when called again, or once ``kernels`` is imported."""
    if not (_CHECKOUT / "kernels" / "cpu_build.py").is_file() or "kernels" in sys.modules:
        return
    if not any(isinstance(f, _KernelsBesideTheCheckout) for f in sys.meta_path):
        sys.meta_path.insert(0, _KernelsBesideTheCheckout())
