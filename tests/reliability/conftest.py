"""Shared by the reliability tests: a tiny target with a tokenizer, and file snapshots.

Every refusal test checks three things: the exit code (or exception type), the message,
and that the user's files are byte-identical afterwards (:func:`snapshot`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from flax import nnx

import specjax
from specjax.drafter import DrafterConfig, EagleDrafter
from specjax.loaded import Drafter
from tests.tiny import make_hf_checkpoint
from tests.vocab.conftest import toy_tokenizer


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (root included) -> its bytes (None for a folder).

    Hidden entries are included, so leftovers such as ``.NAME.partial-*`` show up too.
    """
    root = Path(root)
    if root.is_file():
        return {".": root.read_bytes()}
    out: dict[str, bytes | None] = {".": None}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = None if p.is_dir() else p.read_bytes()
    return out


def hidden_leftovers(folder: Path) -> list[str]:
    """Names of specjax's temporary folders (``.X.partial-*``, ``.X.old-*``) in ``folder``."""
    return sorted(p.name for p in Path(folder).iterdir()
                  if p.name.startswith(".") and (".partial-" in p.name or ".old-" in p.name))


@pytest.fixture(scope="session")
def rel_src(tmp_path_factory) -> Path:
    """A tiny random Llama HF folder with a word-level tokenizer and a ChatML template."""
    path = make_hf_checkpoint(tmp_path_factory.mktemp("rel_src") / "hf", "llama")
    toy_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def rel_dir(rel_src, tmp_path_factory) -> Path:
    """``rel_src`` converted; tests copy it (:func:`copy_of`) before changing anything."""
    return specjax.convert(rel_src, tmp_path_factory.mktemp("rel") / "sj", progress=False)


@pytest.fixture(scope="session")
def rel_target(rel_dir):
    return specjax.load(rel_dir)


@pytest.fixture(scope="session")
def rel_drafter(rel_target) -> Drafter:
    """A random drafter of the right shape: enough for checks that run before drafting."""
    model = EagleDrafter(DrafterConfig(rel_target.cfg), rngs=nnx.Rngs(0))
    return Drafter(cfg=model.cfg, params=model.params())


@pytest.fixture
def copy_of(tmp_path):
    """``copy_of(folder)``: a private copy under tmp_path, to edit freely."""
    def copy(src: Path, name: str = "copy") -> Path:
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return dst

    return copy
