"""Running the CPU kernels' AVX2 build on an AVX-512 host: a check both kernels' tests share.

An AVX-512 host runs the kernels' AVX-512 code, so their AVX2 path (8 lanes: other tiles,
its own sums) would go untested here. Any such host also runs code built for Haswell: the
check builds the kernels that way into a fresh ``SPECJAX_HOME`` (apart from the cached
native build) and runs a test body against them in a child process. An AVX2-only host's
native build is already the AVX2 path, which the kernels' other tests check, so there the
second build (a minute of compiling per kernel) is skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specjax.kernels.cpu_build import cpu_isa

_HASWELL_BUILD = """
from specjax.kernels import cpu_build
cpu_build._FLAGS = tuple("-march=haswell" if f == "-march=native" else f
                         for f in cpu_build._FLAGS)
"""


def run_on_the_avx2_build(body: str, home: Path) -> None:
    """Run ``body`` (Python that imports the kernels, asserts, and prints "ok") with the
    kernels built for Haswell in ``home``; skips where this CPU cannot run AVX2 code, or
    runs nothing but AVX2 code natively."""
    isa = cpu_isa()
    if isa is None:
        pytest.skip("this CPU cannot run AVX2 code")
    if isa == "avx2":
        pytest.skip("this host's native build is the AVX2 build: the other kernel tests check it")
    env = {**os.environ, "SPECJAX_HOME": str(home)}
    proc = subprocess.run([sys.executable, "-c", _HASWELL_BUILD + body], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]
    assert list((home / "kernels").glob("cpu_kernels-*.so"))  # built apart from the cache
