"""Resumable partial results: a benchmark appends one JSON record per finished unit of work
to ``<out stem>.partial.jsonl``, and a restarted run reads them back to skip that work.

A record is written whole and flushed at once, so an interrupt can cut only the last line;
:func:`read_partial` drops such a line, and the work it described is simply done again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specjax.bench.common import jsonable


def partial_path(out: Path) -> Path:
    """``results/bench_spec.json`` -> ``results/bench_spec.partial.jsonl``."""
    return out.with_name(out.stem + ".partial.jsonl")


def resume_from(out: Path, resume: bool) -> tuple[Path, list[dict[str, Any]]]:
    """(the partial file of ``out``, its records): [] and the file removed unless ``resume``."""
    path = partial_path(out)
    if not resume:
        path.unlink(missing_ok=True)
        return path, []
    return path, read_partial(path)


def drafter_stamp(drafter: Any) -> float | None:
    """The drafter manifest's mtime, for resume keys: a drafter retrained in place must not
    resume from the old one's records (None for an in-memory drafter)."""
    if drafter.path is None:
        return None
    manifest = Path(drafter.path) / "specjax.json"
    return manifest.stat().st_mtime if manifest.exists() else None


def read_partial(path: Path) -> list[dict[str, Any]]:
    """The records of a partial file, in the order written; [] if there is none."""
    if not path.exists():
        return []
    recs = []
    for line in path.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by an interrupted write
    return recs


def append_record(path: Path, rec: dict[str, Any]) -> None:
    """Append ``rec`` as one JSON line (:func:`~specjax.bench.common.jsonable`), creating
    the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(jsonable(rec)) + "\n")
        f.flush()
