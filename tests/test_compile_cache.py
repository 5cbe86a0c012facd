"""The persistent compilation cache: a second process running the same generate compiles
nothing (every program is a cache hit), and stats report compile time apart."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

import specjax

SCRIPT = """
import json, sys
from specjax.compile_cache import CompileTimer, enable_compilation_cache
enable_compilation_cache(sys.argv[2])
import specjax
t = specjax.load(sys.argv[1])
with CompileTimer() as ct:
    r = specjax.generate(t, [[1, 2, 3, 4, 5]], max_new_tokens=6)
print(json.dumps({"hits": ct.hits, "misses": ct.misses, "tokens": r.tokens[0],
                  "compile_s": r.stats["compile_s"]}))
"""


def _run(model, cache):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(model), str(cache)], env=env,
                         capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_compiles_nothing(tiny_llama, tmp_path):
    model = specjax.convert(tiny_llama, tmp_path / "sj", progress=False)
    first = _run(model, tmp_path / "jax-cache")
    second = _run(model, tmp_path / "jax-cache")
    assert first["misses"] > 0 and any((tmp_path / "jax-cache").iterdir())
    assert second["misses"] == 0 and second["hits"] >= first["misses"]
    assert second["tokens"] == first["tokens"]


def test_stats_report_compile_time(tiny_target):
    jax.clear_caches()  # so this call compiles (or loads) its programs
    res = specjax.generate(tiny_target, [[1, 2, 3]], max_new_tokens=20)
    assert res.stats["compile_s"] > 0 and res.stats["compiles"] > 0
    # the prefill's own program compiled inside prefill_s, the loop's after it
    assert 0 < res.stats["prefill_compile_s"] < res.stats["compile_s"]
    assert res.stats["prefill_compile_s"] <= res.stats["prefill_s"]
    again = specjax.generate(tiny_target, [[1, 2, 3]], max_new_tokens=20)
    assert again.stats["compiles"] == 0 and again.stats["prefill_compile_s"] == 0
    assert again.stats["decode_tokens_per_s"] > 0


def test_stats_line_shows_prefill_without_its_compile():
    from specjax.commands.generate import stats_line

    line = stats_line({"new_tokens": 9, "decode_tokens_per_s": 50.0, "prefill_s": 1.25,
                       "prefill_compile_s": 1.0, "compile_s": 3.0})
    assert "prefill 0.25 s, compile 3.0 s" in line


def test_cache_path_env(monkeypatch, tmp_path):
    from specjax.compile_cache import default_cache_path

    monkeypatch.setenv("SPECJAX_JAX_CACHE", "off")
    assert default_cache_path() is None
    monkeypatch.setenv("SPECJAX_JAX_CACHE", str(tmp_path / "c"))
    assert default_cache_path() == tmp_path / "c"
    monkeypatch.delenv("SPECJAX_JAX_CACHE")
    monkeypatch.setenv("SPECJAX_HOME", str(tmp_path))
    assert default_cache_path() == tmp_path / "jax-cache"


def test_memory_maps_reads_this_process():
    from specjax.compile_cache import memory_maps

    maps = memory_maps()
    if maps is None:
        return  # not Linux: nothing to read, and nothing to guard
    held, limit = maps
    assert 0 < held < limit


def test_generate_drops_programs_near_the_map_limit(tiny_target, monkeypatch, capsys):
    import specjax.compile_cache as cc

    specjax.generate(tiny_target, [[1, 2, 3]], max_new_tokens=8)  # compiled (or loaded)
    specjax.generate(tiny_target, [[1, 2, 3]], max_new_tokens=8)  # checks, finds room
    # Nothing compiled since the last check: /proc/self/maps is not read at all.
    monkeypatch.setattr(cc, "memory_maps", lambda: pytest.fail("read without a compile"))
    again = specjax.generate(tiny_target, [[1, 2, 3]], max_new_tokens=8)
    assert again.stats["compiles"] == 0
    # Near the limit after a compile: the programs are dropped, so the same call compiles
    # (or loads) them again, and says why.
    cc._compiles_since_check = 1
    monkeypatch.setattr(cc, "memory_maps", lambda: (60_000, 65_530))
    res = specjax.generate(tiny_target, [[1, 2, 3]], max_new_tokens=8)
    assert res.stats["compiles"] > 0 and res.tokens == again.tokens
    assert "vm.max_map_count" in capsys.readouterr().err
    # Far from it: kept.
    monkeypatch.setattr(cc, "memory_maps", lambda: (2_000, 65_530))
    assert specjax.generate(tiny_target, [[1, 2, 3]], max_new_tokens=8).stats["compiles"] == 0
