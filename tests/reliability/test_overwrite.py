"""``convert --overwrite`` replaces only folders specjax wrote, and leaves nothing hidden behind."""

from __future__ import annotations

import os
import shutil

import pytest

import specjax
from specjax.checkpoint import MANIFEST, CheckpointError, write_atomically
from specjax.cli import main
from tests.reliability.conftest import hidden_leftovers, snapshot


def _convert(capsys, *args: str) -> tuple[int, str]:
    rc = main(["convert", *map(str, args)])
    return rc, capsys.readouterr().err


def test_out_is_the_source(rel_src, copy_of, capsys):
    src = copy_of(rel_src, "src")
    before = snapshot(src)
    rc, err = _convert(capsys, src, src, "--overwrite")
    assert rc == 2 and "is the source" in err
    assert snapshot(src) == before and not hidden_leftovers(src.parent)


def test_out_inside_or_containing_the_source(rel_src, copy_of, tmp_path, capsys):
    src = copy_of(rel_src, "a/src")
    before = snapshot(tmp_path / "a")
    rc, err = _convert(capsys, src, src / "sub", "--overwrite")
    assert rc == 2 and "lies inside the source" in err
    rc, err = _convert(capsys, src, tmp_path / "a", "--overwrite")
    assert rc == 2 and "contains the source" in err
    assert snapshot(tmp_path / "a") == before
    assert not (tmp_path / ".a.lock").exists()  # a refusal leaves no lock file either


def test_symlinks_are_resolved(rel_src, copy_of, tmp_path, capsys):
    src = copy_of(rel_src, "src")
    (tmp_path / "link").symlink_to(src)
    before = snapshot(src)
    rc, err = _convert(capsys, src, tmp_path / "link", "--overwrite")
    assert rc == 2 and "is the source" in err
    rc, err = _convert(capsys, tmp_path / "link", src, "--overwrite")
    assert rc == 2 and "is the source" in err
    assert snapshot(src) == before


def test_gguf_onto_itself(tmp_path, capsys):
    g = tmp_path / "model.gguf"
    g.write_bytes(b"GGUF" + bytes(60))
    rc, err = _convert(capsys, g, g, "--overwrite")
    assert rc == 2 and "is the source" in err
    assert g.read_bytes() == b"GGUF" + bytes(60)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_a_users_folder_is_never_replaced(rel_src, tmp_path, capsys):
    d = tmp_path / "d"
    d.mkdir()
    (d / "notes.txt").write_text("my notes")
    before = snapshot(d)
    rc, err = _convert(capsys, rel_src, d, "--overwrite")
    assert rc == 2 and "not a specjax folder" in err and "notes.txt" in err
    assert snapshot(d) == before
    # OUT is checked before the source is read: a broken GGUF gets the OUT message.
    g = tmp_path / "broken.gguf"
    g.write_bytes(b"not a gguf")
    rc, err = _convert(capsys, g, d, "--overwrite")
    assert rc == 2 and "not a specjax folder" in err and "GGUF" not in err
    assert snapshot(d) == before


def test_a_file_is_never_replaced(rel_src, tmp_path, capsys):
    f = tmp_path / "out"
    f.write_text("data")
    rc, err = _convert(capsys, rel_src, f, "--overwrite")
    assert rc == 2 and "is a file" in err and f.read_text() == "data"


def test_empty_and_specjax_folders_are_replaced_cleanly(rel_src, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    rc, _ = _convert(capsys, rel_src, out, "--overwrite")
    assert rc == 0 and (out / MANIFEST).exists()
    (out / "stale.txt").write_text("old")  # a file in a specjax folder goes with it
    rc, _ = _convert(capsys, rel_src, out, "--overwrite")
    assert rc == 0 and not (out / "stale.txt").exists()
    assert not hidden_leftovers(tmp_path)
    specjax.load(out)


def test_leftovers_of_a_killed_write_are_cleaned(rel_dir, rel_src, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(rel_dir, out)
    partial = tmp_path / ".out.partial-0123abcd"
    shutil.copytree(rel_dir, partial)
    old = tmp_path / ".out.old-89abcdef"
    shutil.copytree(rel_dir, old)
    users = [tmp_path / ".out.old-notes", tmp_path / ".out.partial-mine"]  # not specjax names
    for u in users:
        u.mkdir()
    rc, _ = _convert(capsys, rel_src, out, "--overwrite")
    assert rc == 0
    assert not partial.exists() and not old.exists()
    assert all(u.exists() for u in users)


def test_killed_between_the_renames_restores_the_previous_folder(rel_dir, rel_src, tmp_path,
                                                                 capsys):
    # OUT was moved aside and the kill came before the new one was renamed in.
    old = tmp_path / ".out.old-0123abcd"
    shutil.copytree(rel_dir, old)
    before = snapshot(old)
    rc, err = _convert(capsys, rel_src, tmp_path / "out")
    assert rc == 2 and "already exists" in err  # the previous OUT is back: nothing lost
    assert snapshot(tmp_path / "out") == before and not old.exists()


def test_a_failed_build_leaves_nothing(tmp_path):
    out = tmp_path / "out"

    def build(tmp):
        (tmp / "half").write_text("x")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        write_atomically(out, build)
    assert not out.exists() and not hidden_leftovers(tmp_path)


def test_dangling_or_looping_symlink_out(rel_src, tmp_path, capsys):
    (tmp_path / "out").symlink_to(tmp_path / "gone")
    rc, err = _convert(capsys, rel_src, tmp_path / "out")
    assert rc == 2 and "does not exist" in err
    assert os.path.islink(tmp_path / "out") and not (tmp_path / "gone").exists()
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    rc, err = _convert(capsys, rel_src, tmp_path / "a", "--overwrite")
    assert rc == 2 and "loops" in err and os.path.islink(tmp_path / "a")


def test_convert_api_checks_its_arguments(rel_src, tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        specjax.convert(rel_src, tmp_path / "o", dtype="int8")
    with pytest.raises(TypeError):
        specjax.convert(rel_src, None)
    with pytest.raises(CheckpointError, match="no such file"):
        specjax.convert(tmp_path / "missing", tmp_path / "o")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
