"""Named models for --model: the name selects the cached conversion; a folder wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from specjax.checkpoint import MANIFEST
from specjax.defaults import GEMMA3_MODEL_NAME, NAMED_MODELS, is_named, resolve_model


def test_a_name_selects_the_cached_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_HOME", str(tmp_path / "home"))
    cached = tmp_path / "home" / GEMMA3_MODEL_NAME
    cached.mkdir(parents=True)
    (cached / MANIFEST).write_text("{}")  # already converted: nothing is read or converted
    monkeypatch.chdir(tmp_path)
    assert resolve_model(GEMMA3_MODEL_NAME) == cached
    assert is_named(GEMMA3_MODEL_NAME, GEMMA3_MODEL_NAME) and is_named(None, next(iter(
        NAMED_MODELS)))
    (tmp_path / GEMMA3_MODEL_NAME).mkdir()  # a folder of that name is what the user means
    assert resolve_model(GEMMA3_MODEL_NAME) == Path(GEMMA3_MODEL_NAME)
    assert not is_named(GEMMA3_MODEL_NAME, GEMMA3_MODEL_NAME)


def test_an_unknown_name_is_a_path(tmp_path):
    assert resolve_model(tmp_path / "gemma3-1b") == tmp_path / "gemma3-1b"
    from specjax.defaults import ensure_default_target

    with pytest.raises(ValueError, match="unknown model name 'gemma3-1b'; named models: "):
        ensure_default_target(name="gemma3-1b")
