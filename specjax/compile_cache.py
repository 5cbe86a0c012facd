"""Paying compilation once: JAX's persistent compilation cache, and timing what compiles.

:func:`enable_compilation_cache` points JAX's persistent cache at ``$SPECJAX_HOME/jax-cache``
(``~/.cache/specjax/jax-cache`` by default), so a second process running the same programs
(e.g. a second ``specjax generate`` of the same shape buckets) loads the compiled
executables from disk instead of compiling them again. Every program is cached, however
small or quick to compile: the CLI's programs are few and a hit costs milliseconds.
``SPECJAX_JAX_CACHE=off`` turns it off; ``SPECJAX_JAX_CACHE=PATH`` moves it.

:class:`CompileTimer` adds up the time JAX spends tracing, lowering and compiling (or
loading from the persistent cache) inside a block, so statistics can report compile time
apart from decoding speed, and counts persistent-cache hits and misses.

:func:`release_programs_near_map_limit` drops the compiled programs a long session has
accumulated before Linux's per-process limit on memory maps makes the next compile fail.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import jax

ENV = "SPECJAX_JAX_CACHE"
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
_HIT = "/jax/compilation_cache/cache_hits"
_MISS = "/jax/compilation_cache/cache_misses"


def default_cache_path() -> Path | None:
    """Where the cache lives: ``$SPECJAX_JAX_CACHE``, else ``$SPECJAX_HOME/jax-cache``;
    None when ``$SPECJAX_JAX_CACHE`` is ``off`` (or ``0``, ``none``, empty)."""
    env = os.environ.get(ENV)
    if env is not None:
        return None if env.strip().lower() in ("", "0", "off", "none", "false") else Path(env)
    home = os.environ.get("SPECJAX_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "specjax") / "jax-cache"


def enable_compilation_cache(path: str | Path | None = None) -> Path | None:
    """Turn on JAX's persistent compilation cache at ``path`` (default
    :func:`default_cache_path`); returns the folder, or None when turned off.

    Call it before the first compilation of the process. Entries of any size and compile
    time are written (``jax_persistent_cache_min_compile_time_secs = 0``,
    ``..._min_entry_size_bytes = -1``).
    """
    path = Path(path) if path is not None else default_cache_path()
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        # The cache only saves time: an unwritable SPECJAX_HOME must not stop a run that
        # needs nothing else from it (e.g. generate --model DIR).
        print(f"specjax: no compilation cache ({e.strerror or e}: {path}); set "
              f"{ENV}=PATH or SPECJAX_HOME to a writable folder, or {ENV}=off",
              file=sys.stderr)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


class CompileTimer:
    """Context manager: compile time and persistent-cache hits inside the block.

    ``seconds`` is the tracing + lowering + compile (or cache load) time; ``since(t)`` the
    part of it that ended after ``time.perf_counter()`` read ``t`` (e.g. after a prefill).
    """

    def __init__(self) -> None:
        self.events: list[tuple[float, str, float]] = []  # (perf_counter at end, event, s)
        self.hits = 0
        self.misses = 0

    def _on_duration(self, event: str, duration: float, **kwargs: Any) -> None:
        if event in COMPILE_EVENTS:
            self.events.append((time.perf_counter(), event, float(duration)))

    def _on_event(self, event: str, **kwargs: Any) -> None:
        if event == _HIT:
            self.hits += 1
        elif event == _MISS:
            self.misses += 1

    def __enter__(self) -> CompileTimer:
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc: Any) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_duration)
        jax.monitoring.unregister_event_listener(self._on_event)

    @property
    def seconds(self) -> float:
        return sum(d for _, _, d in self.events)

    @property
    def backend_compiles(self) -> int:
        """XLA compilations (persistent-cache loads included)."""
        return sum(1 for _, e, _ in self.events if e == COMPILE_EVENTS[2])

    def since(self, t: float) -> float:
        return sum(d for end, _, d in self.events if end > t)


# Memory maps. XLA:CPU maps each executable's code and data sections on their own: a
# speculative program pair (prefill + loop) at batch 1 holds about 1,100 of the process's
# memory maps, a batch-16 loop up to about 3,000 (sixty-seventh and sixty-eighth sessions,
# counted in /proc/self/maps). Linux refuses a process more than vm.max_map_count of them
# (65,530 by default), and LLVM then fails to compile the next program with "Cannot allocate
# memory" however much memory is free: about 55 speculative configurations tried in one
# process (trees, heads, lengths) reach it. Dropping JAX's in-memory programs gives the maps
# back; a program that is needed again compiles, or loads from the persistent cache.
MAPS_FILE = Path("/proc/self/maps")
MAP_LIMIT_FILE = Path("/proc/sys/vm/max_map_count")
# Maps kept free: room for a few more programs (a generate call compiles two) before the
# next check.
MAP_HEADROOM = 12_000
_compiles_since_check = 0
_listening = False


def memory_maps() -> tuple[int, int] | None:
    """(memory maps this process holds, the kernel's per-process limit), or None where
    /proc does not say (not Linux)."""
    try:
        limit = int(MAP_LIMIT_FILE.read_text())
        with MAPS_FILE.open("rb") as f:
            return f.read().count(b"\n"), limit
    except (OSError, ValueError):
        return None


def _count_compile(event: str, duration: float, **kwargs: Any) -> None:
    global _compiles_since_check
    if event == COMPILE_EVENTS[2]:
        _compiles_since_check += 1


def release_programs_near_map_limit(headroom: int = MAP_HEADROOM) -> bool:
    """Drop JAX's compiled programs (``jax.clear_caches``) when this process holds more
    than ``limit - headroom`` memory maps; True when it did.

    Called by :func:`specjax.generate` before it compiles, so a session that tries many
    trees or heads keeps running instead of failing in LLVM. Reading /proc/self/maps costs
    about a microsecond a map, so it is read only when a program was compiled (or loaded
    from the persistent cache) since the last check.
    """
    global _compiles_since_check, _listening
    if not _listening:  # counting starts at the first call; the first call always checks
        jax.monitoring.register_event_duration_secs_listener(_count_compile)
        _listening, _compiles_since_check = True, 1
    if _compiles_since_check == 0:
        return False
    _compiles_since_check = 0
    maps = memory_maps()
    if maps is None or maps[0] <= maps[1] - headroom:
        return False
    jax.clear_caches()
    print(f"specjax: this process holds {maps[0]:,} memory maps, near the kernel's limit of "
          f"{maps[1]:,} (vm.max_map_count; each compiled program holds about a thousand): "
          f"dropped the compiled programs, which recompile (or load from the persistent "
          f"cache) when used again", file=sys.stderr)
    return True
