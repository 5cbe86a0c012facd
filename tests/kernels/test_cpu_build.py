"""The CPU kernels' build (kernels/cpu_build.py): a host without a compiler gets a reason, the
instruction set follows the CPU's flags, and both vector paths of every source compile."""

from __future__ import annotations

import subprocess

import pytest

from specjax.kernels import cpu_build


def test_missing_compiler_is_a_reason_not_a_crash(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    path, why = cpu_build._build.__wrapped__()
    assert path is None and "no C++ compiler" in why


def test_a_cpu_without_the_vector_units_is_a_reason(monkeypatch):
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: frozenset({"sse2", "avx2"}))
    path, why = cpu_build._build.__wrapped__()
    assert path is None and "neither AVX-512F nor AVX2 with FMA" in why


def test_the_instruction_set_follows_the_cpus_flags():
    assert cpu_build._cpu_isa(frozenset({"sse2", "avx2", "fma", "avx512f"})) == "avx512f"
    assert cpu_build._cpu_isa(frozenset({"sse2", "avx2", "fma"})) == "avx2"  # e.g. AMD Zen 3
    assert cpu_build._cpu_isa(frozenset({"sse2", "avx2"})) is None  # AVX2 without FMA
    assert cpu_build._cpu_isa(frozenset()) is None


def test_every_kernel_switch_reads_off(monkeypatch):
    monkeypatch.delenv("SPECJAX_CPU_ATTENTION", raising=False)
    assert cpu_build.kernels_enabled("SPECJAX_CPU_ATTENTION")
    for off in ("off", "0", "false", "OFF"):
        monkeypatch.setenv("SPECJAX_CPU_ATTENTION", off)
        assert not cpu_build.kernels_enabled("SPECJAX_CPU_ATTENTION")


@pytest.mark.parametrize("march,ok", [("skylake-avx512", True), ("haswell", True),
                                      ("x86-64", False)])
def test_both_vector_paths_compile_and_older_cpus_get_a_clear_error(march, ok):
    """Whatever this host has, the AVX-512 and the AVX2 paths of every source must compile
    (a syntax check for the other CPU), and a CPU with neither stops at the shared header's
    #error."""
    cxx = cpu_build._compiler()
    if cxx is None:
        pytest.skip("no C++ compiler (g++, or $CXX): the kernels are not built here either")
    flags = [f for f in cpu_build._FLAGS if f not in ("-march=native", "-shared", "-fPIC")]
    proc = subprocess.run([cxx, *cpu_build._compile_args([*flags, f"-march={march}",
                                                          "-fsyntax-only"])],
                          capture_output=True, text=True, timeout=300)
    assert (proc.returncode == 0) == ok, proc.stderr[-2000:]
    if not ok:
        assert "need AVX-512F, or AVX2 with FMA" in proc.stderr
