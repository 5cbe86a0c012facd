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
