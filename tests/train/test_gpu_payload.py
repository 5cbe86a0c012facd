"""What prepare.py sends beside the payload: the tokenizer files and the gguf wheel."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

_PREPARE = Path(__file__).parents[2] / "examples" / "gpu_drafter" / "prepare.py"
_spec = importlib.util.spec_from_file_location("gpu_drafter_prepare_payload", _PREPARE)
prepare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prepare)


def test_copy_tokenizer_copies_the_files_a_converted_target_has(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "tokenizer.json").write_text("{}")
    (target / "chat_template.jinja").write_text("{{ messages }}")
    (target / "config.json").write_text("{}")  # not a tokenizer file: stays behind
    names = prepare.copy_tokenizer(target, tmp_path / "out" / "tokenizer")
    assert names == ["tokenizer.json", "chat_template.jinja"]
    assert sorted(p.name for p in (tmp_path / "out" / "tokenizer").iterdir()) == [
        "chat_template.jinja", "tokenizer.json"]


def test_copy_tokenizer_refuses_a_target_without_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json.*specjax convert"):
        prepare.copy_tokenizer(tmp_path, tmp_path / "tok")


def test_gguf_pin_reads_the_gpu_lock(tmp_path):
    assert prepare.gguf_pin() == prepare.gguf_pin(prepare.GPU_LOCK)
    assert prepare.gguf_pin().count(".") >= 1
    lock = tmp_path / "lock.txt"
    lock.write_text("numpy==2.3.0\n")
    with pytest.raises(ValueError, match="pins no gguf"):
        prepare.gguf_pin(lock)


def test_a_wheel_already_there_is_not_downloaded_again(tmp_path, monkeypatch):
    wheel = tmp_path / "gguf-0.19.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("downloaded"))
    assert prepare.download_gguf_wheel(tmp_path, "0.19.0") == wheel


def test_a_failed_download_says_how_to_get_the_wheel(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, returncode=1))
    with pytest.raises(RuntimeError, match="pip download.*gguf==0.19.0.*--no-wheel"):
        prepare.download_gguf_wheel(tmp_path, "0.19.0")
