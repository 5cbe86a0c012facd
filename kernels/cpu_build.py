"""Builds the CPU kernels' C++ sources (XLA FFI custom calls) on first use, and registers them.

The sources ship beside this file: ``cpu_rowdot.cc`` (:mod:`specjax.kernels.cpu_rowdot`) and
``cpu_attention.cc`` (:mod:`specjax.kernels.cpu_attention`), with the headers they share
(``cpu_simd.h``: the vector type; ``cpu_pool.h``: work sharing on XLA's intra-op pool). The
first :func:`available` compiles them with the host's g++ (``$CXX``) into one library in
``$SPECJAX_HOME/kernels``, keyed by the sources, the flags, the jaxlib version and the CPU's
feature flags (``-march=native`` code may not run on another CPU sharing the folder), and
registers every FFI target for the CPU platform. AVX-512F is used where the CPU has it, else
AVX2 with FMA. Hosts without g++ or either get ``available()`` False and a reason, and every
caller keeps XLA's own ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

_DIR = Path(__file__).parent
_SOURCES = (_DIR / "cpu_rowdot.cc", _DIR / "cpu_attention.cc")
_HEADERS = (_DIR / "cpu_simd.h", _DIR / "cpu_pool.h")
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
# FFI target name -> the handler symbol the library exports.
TARGETS = {
    "specjax_cpu_rowdot": "SpecjaxRowDot",
    "specjax_cpu_rowdot_gathered": "SpecjaxRowDotGathered",
    "specjax_cpu_cache_attention": "SpecjaxCacheAttention",
}


def _kernel_dir() -> Path:
    home = os.environ.get("SPECJAX_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "specjax") / "kernels"


def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (the first ``flags`` line of /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def _cpu_isa(flags: frozenset[str]) -> str | None:
    """The vector instructions the kernels will use on a CPU with ``flags``, or None."""
    if "avx512f" in flags:
        return "avx512f"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return None


@functools.cache
def cpu_isa() -> str | None:
    """This host's kernel ISA: "avx512f", "avx2" (with FMA), or None where the kernels do not
    build; what a CPU's verify-cost curve, and so its fastest tree, depends on."""
    return _cpu_isa(_cpu_flags())


def _compiler() -> str | None:
    """The C++ compiler that builds the kernels ($CXX, else g++): its path, None if absent."""
    return shutil.which(os.environ.get("CXX", "g++"))


def _compile_args(flags: tuple[str, ...] | list[str]) -> list[str]:
    """What follows the compiler on the command line: ``flags``, the include paths (XLA's
    FFI headers, the shared headers) and the sources."""
    return [*flags, "-w", "-I", jax.ffi.include_dir(), "-I", str(_DIR), *map(str, _SOURCES)]


@functools.cache
def _build() -> tuple[Path | None, str]:
    """The compiled library (built once per sources, flags, jaxlib and CPU), or None and why."""
    cpu = _cpu_flags()
    if _cpu_isa(cpu) is None:
        return None, "the CPU has neither AVX-512F nor AVX2 with FMA"
    cxx = _compiler()
    if cxx is None:
        return None, "no C++ compiler (g++, or $CXX) on PATH"
    key = hashlib.sha256()
    for path in (*_SOURCES, *_HEADERS):
        key.update(path.name.encode() + b"\0" + path.read_bytes())
    key.update(" ".join(_FLAGS).encode() + jaxlib.__version__.encode()
               + " ".join(sorted(cpu)).encode())
    out = _kernel_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out, ""
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a concurrent process never loads half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    proc = subprocess.run([cxx, *_compile_args(_FLAGS), "-o", tmp], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        return None, f"compiling the CPU kernels failed: {proc.stderr.strip()[-400:]}"
    os.replace(tmp, out)
    return out, ""


@functools.cache
def _register() -> str:
    """Register every FFI target once per process; '' on success, else the reason."""
    path, why = _build()
    if path is None:
        return why
    lib = ctypes.cdll.LoadLibrary(str(path))
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    return ""


def available() -> tuple[bool, str]:
    """Whether the CPU kernels can run here (builds them on first call), and if not, why."""
    why = _register()
    return not why, why


def kernels_enabled(env: str) -> bool:
    """Whether the environment variable ``env`` (e.g. ``SPECJAX_CPU_ROWDOT``) leaves a kernel
    on: anything but ``off``, ``0`` or ``false`` (unset is ``auto``)."""
    return os.environ.get(env, "auto").lower() not in ("off", "0", "false")
