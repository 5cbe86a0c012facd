"""Shared fixtures: tiny random HF checkpoints made on the fly."""

from __future__ import annotations

import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import numpy as np  # noqa: E402

import specjax  # noqa: E402
from tests.tiny import make_hf_checkpoint  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _shared_compilation_cache(pytestconfig, tmp_path_factory):
    """One persistent compilation cache for every run of the suite in this checkout: both
    xdist workers and the CLI children they start (through ``SPECJAX_JAX_CACHE``, which
    children inherit) read and write ``.pytest_cache/d/jax-cache``.

    A repeated run loads most programs instead of compiling them (compiles dominate the
    suite's time), and the suite no longer writes compiled programs into the user's
    ``~/.cache/specjax`` (the benchmark commands it runs turn the cache on).
    ``pytest --cache-clear`` empties it; a clean clone (CI) starts cold. A
    ``SPECJAX_JAX_CACHE`` already set (``off`` included) is respected.
    """
    from specjax.compile_cache import ENV, enable_compilation_cache

    cache = pytestconfig.cache  # None under ``-p no:cacheprovider``
    path = cache.mkdir("jax-cache") if cache is not None else (
        tmp_path_factory.getbasetemp() / "jax-cache")
    os.environ.setdefault(ENV, str(path))
    enable_compilation_cache()


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop each test module's compiled programs when it ends.

    XLA:CPU maps every compiled executable's code into memory mappings of its own, and one
    pytest process compiles thousands of programs: past the kernel's ``vm.max_map_count``
    (65,530 by default) the next compile aborts the whole run (a fresh-clone run died at 93%
    in a jax cache write). A program a later module needs again is compiled again.
    """
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny untied Llama with GQA, saved as an HF folder."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' fp32 load of the real SmolLM2-135M-Instruct GGUF (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specjax.defaults import smollm2_gguf_path

    path = smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """The real SmolLM2 GGUF converted by ``specjax convert`` into a fresh folder."""
    from specjax.convert import convert
    from specjax.defaults import smollm2_gguf_path

    return convert(smollm2_gguf_path(), tmp_path_factory.mktemp("smollm2") / "SmolLM2",
                   progress=False)


@pytest.fixture(scope="session")
def tiny_target(tiny_llama, tmp_path_factory):
    """The tiny Llama converted: the target of the speculative and vocabulary tests."""
    return specjax.load(specjax.convert(tiny_llama, tmp_path_factory.mktemp("spec") / "sj",
                                        progress=False))


@pytest.fixture(scope="session")
def fitted_drafter(tiny_target):
    """An EAGLE drafter fitted to the tiny target's own greedy text.

    Random tiny targets fall into short cycles that a drafter learns quickly, so
    speculative steps accept several tokens and exercise deep paths. A random
    target has nothing to generalise from, so the training text includes the
    continuations of the prompts the tests use: this fixture exercises the
    machinery, not the drafter's quality.
    """
    from tests.speculative.conftest import PROMPTS, fit_drafter

    rs = np.random.RandomState(0)
    prompts = PROMPTS + [rs.randint(3, 256, rs.randint(3, 9)).tolist() for _ in range(13)]
    gens = specjax.generate(tiny_target, prompts, max_new_tokens=64, stop_on_eos=False).tokens
    return fit_drafter(tiny_target, [p + g for p, g in zip(prompts, gens, strict=True)])
