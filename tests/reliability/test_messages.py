"""Faults that used to end in a traceback now end in a message naming the file or field."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import specjax
from specjax.checkpoint import MANIFEST, CheckpointError
from specjax.cli import main
from specjax.vocab.corpus_counts import iter_corpus
from specjax.vocab.shortlist import import_token_list
from tests.reliability.conftest import snapshot

REPO = Path(__file__).resolve().parents[2]


def _edit_manifest(folder: Path, fn) -> None:
    path = folder / MANIFEST
    manifest = json.loads(path.read_text())
    fn(manifest)
    path.write_text(json.dumps(manifest))


# --------------------------------------------------------------------------- manifests


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(num_layers=3), "config num_layers=3 but the tensors hold 2 layers"),
    (lambda c: c.update(num_layers=1), "config num_layers=1 but the tensors hold 2 layers"),
    (lambda c: c.update(hidden_size=80), "hidden_size=80"),
    (lambda c: c.update(vocab_size=300), "tensor embed has shape [256, 64] but config "
                                         "hidden_size=64, vocab_size=300 gives [300, 64]"),
    (lambda c: c.update(intermediate_size=95), "intermediate_size=95"),
    (lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings=True"),
    (lambda c: c.update(attention_bias=True), "attention_bias=True"),
    (lambda c: c.update(num_kv_heads=0), "num_kv_heads must be a positive integer, got 0"),
    (lambda c: c.update(num_heads="4"), "num_heads must be a positive integer, got '4'"),
    (lambda c: c.update(rope_theta=None), "rope_theta must be a finite number > 0"),
    (lambda c: c.update(extra=1), "unknown fields ['extra']"),
    (lambda c: c.pop("vocab_size"), "lacks the required fields ['vocab_size']"),
    (lambda c: c.update(eos_token_ids="2"), "eos_token_ids must be a list of ints"),
])
def test_manifest_config_disagreeing_with_tensors(rel_dir, copy_of, capsys, edit, message):
    m = copy_of(rel_dir)
    _edit_manifest(m, lambda man: edit(man["config"]))
    before = snapshot(m)
    with pytest.raises(CheckpointError, match="specjax.json") as e:
        specjax.load(m)
    assert message in str(e.value)
    rc = main(["generate", "--model", str(m), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err
    assert snapshot(m) == before


@pytest.mark.parametrize("text, message", [
    ("[]", "not an object"), ("{", "is corrupt"), (b"\xff\xfe", "is corrupt"),
])
def test_manifest_that_is_not_a_json_object(rel_dir, copy_of, text, message):
    m = copy_of(rel_dir)
    (m / MANIFEST).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(CheckpointError, match=message):
        specjax.load(m)


def test_manifest_tensor_table_that_is_not_shapes(rel_dir, copy_of):
    m = copy_of(rel_dir)
    _edit_manifest(m, lambda man: man["tensors"].update(embed="big"))
    with pytest.raises(CheckpointError, match="tensor embed has shape None"):
        specjax.load(m)


def test_drafter_manifest_disagreeing_with_tensors(rel_target, tmp_path):
    from flax import nnx

    from specjax.drafter import DrafterConfig, EagleDrafter, save_drafter

    model = EagleDrafter(DrafterConfig(rel_target.cfg), rngs=nnx.Rngs(0))
    d = save_drafter(tmp_path / "d", model.cfg, model.params())
    _edit_manifest(d, lambda man: man["config"].update(fc_bias=False))
    with pytest.raises(CheckpointError, match="unexpected tensors"):
        specjax.load_drafter(d, rel_target)
    _edit_manifest(d, lambda man: man["config"].update(fc_bias="yes"))
    with pytest.raises(CheckpointError, match="fc_bias must be true or false"):
        specjax.load_drafter(d, rel_target)


def test_truncated_params_print_one_message_and_no_traceback(rel_dir, copy_of):
    m = copy_of(rel_dir)
    biggest = max((p for p in (m / "params").rglob("*") if p.is_file()),
                  key=lambda p: p.stat().st_size)
    with open(biggest, "r+b") as f:
        f.truncate(biggest.stat().st_size // 3)
    before = snapshot(m)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "specjax.cli", "generate", "--model", str(m),
                        "--prompt", "hi", "--max-new-tokens", "1"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "bytes, the manifest says" in r.stderr and "convert it again" in r.stderr
    assert "Traceback" not in r.stderr and "Event loop is closed" not in r.stderr, r.stderr
    assert snapshot(m) == before


def test_missing_tensor_file_is_named(rel_dir, copy_of):
    m = copy_of(rel_dir)
    victim = next(p for p in sorted((m / "params").rglob("*")) if p.is_file())
    victim.unlink()
    with pytest.raises(CheckpointError, match=r"params/.* is missing.*convert it again"):
        specjax.load(m)


def test_truncation_without_a_file_table_is_left_to_orbax(rel_dir, copy_of):
    # Checkpoints written before the manifest listed file sizes still fail clearly.
    m = copy_of(rel_dir)
    _edit_manifest(m, lambda man: man.pop("files"))
    biggest = max((p for p in (m / "params").rglob("*") if p.is_file()),
                  key=lambda p: p.stat().st_size)
    with open(biggest, "r+b") as f:
        f.truncate(biggest.stat().st_size // 3)
    with pytest.raises(CheckpointError, match="cannot restore tensors.*convert it again"):
        specjax.load(m)


# --------------------------------------------------------------------------- SPECJAX_HOME


def test_unwritable_specjax_home_names_the_variable(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SPECJAX_HOME", str(blocker / "home"))
    rc = main(["generate", "--prompt", "hi", "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "set SPECJAX_HOME to a writable folder" in err
    assert blocker.read_text() == "not a folder"


def test_unwritable_specjax_home_does_not_stop_an_explicit_model(rel_dir, tmp_path,
                                                                monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SPECJAX_HOME", str(blocker / "home"))
    monkeypatch.delenv("SPECJAX_JAX_CACHE", raising=False)
    rc = main(["generate", "--model", str(rel_dir), "--prompt", "hi", "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert rc == 0 and "no compilation cache" in err and "SPECJAX_HOME" in err


def test_read_only_specjax_home_names_the_variable(tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("SPECJAX_HOME", str(home))
    monkeypatch.setenv("SPECJAX_JAX_CACHE", "off")  # this test simulates only the lock

    class ReadOnly:  # what creating the lock file in a read-only folder gives (even as root)
        def __init__(self, path):
            self.path = path

        def acquire(self, *a, **k):
            raise PermissionError(13, "Permission denied", self.path)

    monkeypatch.setattr("specjax.checkpoint._LOCKS", {})
    monkeypatch.setattr("specjax.checkpoint.FileLock", ReadOnly)
    rc = main(["generate", "--prompt", "hi", "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "set SPECJAX_HOME to a writable folder" in err
    assert "Permission denied" in err and list(home.iterdir()) == []


# --------------------------------------------------------------------------- build-shortlist


def test_build_shortlist_out_is_a_file(rel_dir, tmp_path, capsys):
    f = tmp_path / "out.txt"
    f.write_text("keep me")
    for out in (f, f / "sub"):
        rc = main(["build-shortlist", "--model", str(rel_dir), "--out", str(out),
                   "--import", str(tmp_path / "x.npy")])
        err = capsys.readouterr().err
        assert rc == 2 and ("is a file" in err or "which is a file" in err), err
    assert f.read_text() == "keep me"


def _torch_zip(path: Path, pkl: bytes, storages: dict[str, bytes] | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
        for key, data in (storages or {}).items():
            z.writestr(f"archive/data/{key}", data)
    return path


def _s(text: str) -> bytes:  # pickle BINUNICODE
    return b"X" + struct.pack("<I", len(text)) + text.encode()


def _rebuild(numel: int, size: int, stride: int) -> bytes:
    """A pickle calling torch._utils._rebuild_tensor_v2 on one LongStorage."""
    return (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(" + b"(" + _s("storage")
            + b"ctorch\nLongStorage\n" + _s("0") + _s("cpu") + b"J" + struct.pack("<i", numel)
            + b"tQ" + b"K\x00" + b"J" + struct.pack("<i", size) + b"\x85" + b"J"
            + struct.pack("<i", stride) + b"\x85" + b"\x89"
            + b"ccollections\nOrderedDict\n)R" + b"tR.")


@pytest.mark.parametrize("pkl, message", [
    (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n)R.", "missing 4 required"),  # no arguments
    (b"\x80\x02ccollections\nOrderedDict\nK\x05\x85R.", "TypeError"),  # OrderedDict(5)
    (b"\x80\x02ctorch\nLongStorage\n)R.", "TypeError"),  # a storage type called
    (_rebuild(1, 10**9, 0), "does not fit its storage"),  # 8 bytes as an 8 GB tensor
    (b"\x80\x02cos\nsystem\n" + _s("touch /tmp/x") + b"\x85R.", "unsupported object os.system"),
])
def test_crafted_torch_files(tmp_path, capsys, rel_dir, pkl, message):
    pt = _torch_zip(tmp_path / "freq.pt", pkl, {"0": struct.pack("<3q", 5, 6, 7)})
    before = pt.read_bytes()
    with pytest.raises(ValueError, match="freq.pt") as e:
        import_token_list(pt, vocab_size=256)
    assert message in str(e.value)
    rc = main(["build-shortlist", "--model", str(rel_dir), "--import", str(pt), "--out",
               str(tmp_path / "out")])
    assert rc == 2 and message in capsys.readouterr().err
    assert pt.read_bytes() == before and not (tmp_path / "out").exists()


def test_a_well_formed_torch_list_still_imports(tmp_path):
    pt = _torch_zip(tmp_path / "ok.pt", _rebuild(3, 3, 1), {"0": struct.pack("<3q", 5, 6, 7)})
    assert import_token_list(pt, vocab_size=256).ids.tolist() == [5, 6, 7]


# --------------------------------------------------------------------------- JSON files


def test_json_errors_in_config_json_name_the_file(rel_src, copy_of, tmp_path, capsys):
    src = copy_of(rel_src, "src")
    (src / "config.json").write_text('{"model_type": "llama",')
    before = snapshot(src)
    rc = main(["convert", str(src), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and f"{src / 'config.json'} is not valid JSON" in err
    (src / "config.json").write_text('{"model_type": "llama"}')
    rc = main(["convert", str(src), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "config.json" in err and "num_attention_heads" in err
    assert not (tmp_path / "out").exists() and snapshot(src).keys() == before.keys()


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json",
                                  "special_tokens_map.json"])
def test_json_errors_in_tokenizer_files_name_the_file(rel_dir, copy_of, capsys, name):
    m = copy_of(rel_dir)
    (m / name).write_text("{oops")
    before = snapshot(m)
    rc = main(["generate", "--model", str(m), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{name} is not valid JSON" in err
    assert snapshot(m) == before


def test_a_tokenizer_json_of_the_wrong_shape_names_the_folder(rel_dir, copy_of, capsys):
    m = copy_of(rel_dir)
    (m / "tokenizer.json").write_text('{"model": 5}')
    rc = main(["generate", "--model", str(m), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot load the tokenizer" in err and str(m) in err


@pytest.mark.parametrize("name, data, message", [
    ("c.jsonl", b'{"text": "a"}\n{"text": \n', "c.jsonl:2: not JSON"),
    ("c.jsonl", b'{"text": "a"}\n{"text": "caf\xe9"}\n', "c.jsonl: line 2, byte 14 is not valid"),
    ("c.txt", b"hello\n\nw\xffrld\n", "c.txt: line 3, byte 2 is not valid UTF-8"),
])
def test_corpus_errors_name_the_file(rel_target, rel_dir, tmp_path, capsys, name, data,
                                     message):
    corpus = tmp_path / name
    corpus.write_bytes(data)
    with pytest.raises(ValueError, match="not") as e:
        list(iter_corpus(corpus, rel_target.tokenizer))
    assert message in str(e.value)
    rc = main(["build-shortlist", "--model", str(rel_dir), "--corpus", str(corpus), "--out",
               str(tmp_path / "out"), "--sizes", "8", "--no-progress"])
    assert rc == 2 and message in capsys.readouterr().err
    assert corpus.read_bytes() == data


def test_an_interrupt_is_one_line(monkeypatch, rel_src, tmp_path, capsys):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(specjax, "convert", interrupted)
    assert main(["convert", str(rel_src), str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err.strip() == "specjax convert: interrupted"


def test_missing_drafter_folder(rel_target, tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        specjax.load_drafter(tmp_path / "nope", rel_target)
    with pytest.raises(TypeError, match="target must be a Target"):
        specjax.load_drafter(tmp_path / "nope", "target")
