"""specjax never runs code from a model folder and never prompts: such folders are refused."""

from __future__ import annotations

import ast
import builtins
import json
from pathlib import Path

import pytest

import specjax
from specjax.cli import main
from specjax.tokenizer import TokenizerError, load_tokenizer
from tests.reliability.conftest import snapshot

REPO = Path(__file__).resolve().parents[2]
EVIL = "import pathlib\npathlib.Path({marker!r}).touch()\n" \
       "from transformers import PreTrainedTokenizerFast as EvilTok\n"


@pytest.fixture(autouse=True)
def no_prompt(monkeypatch):
    """transformers asks ``[y/N]`` through input(); any call fails the test."""
    def refuse(*_a, **_k):
        raise AssertionError("specjax prompted the user")

    monkeypatch.setattr(builtins, "input", refuse)


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _evil_folder(folder: Path, tmp_path: Path, file: str = "tokenizer_config.json") -> Path:
    """The issue's repro: an auto_map that points at evil_tok.py, which touches a marker."""
    marker = tmp_path / "PWNED"
    (folder / "evil_tok.py").write_text(EVIL.format(marker=str(marker)))
    _edit_json(folder / file, tokenizer_class="EvilTok",
               auto_map={"AutoTokenizer": [None, "evil_tok.EvilTok"]})
    return marker


@pytest.mark.parametrize("file", ["tokenizer_config.json", "config.json"])
def test_auto_map_is_refused_and_never_run(rel_dir, copy_of, tmp_path, capsys, file):
    m = copy_of(rel_dir)
    marker = _evil_folder(m, tmp_path, file)
    before = snapshot(m)
    with pytest.raises(TokenizerError, match=f'{file} has an "auto_map" field'):
        specjax.load(m)
    rc = main(["generate", "--model", str(m), "--prompt", "hi", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "auto_map" in err and "never runs code" in err
    assert not marker.exists()
    assert snapshot(m) == before


def test_unknown_tokenizer_class_is_refused(rel_dir, copy_of, capsys):
    m = copy_of(rel_dir)
    _edit_json(m / "tokenizer_config.json", tokenizer_class="EvilTok")
    before = snapshot(m)
    rc = main(["generate", "--model", str(m), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and '"tokenizer_class": "EvilTok"' in err
    # A model class is not a tokenizer class either (and is refused without importing it).
    _edit_json(m / "tokenizer_config.json", tokenizer_class="LlamaForCausalLM")
    with pytest.raises(TokenizerError, match="not a tokenizer class"):
        load_tokenizer(m)
    _edit_json(m / "tokenizer_config.json", tokenizer_class=["x"])
    with pytest.raises(TokenizerError, match="tokenizer_class"):
        load_tokenizer(m)
    assert snapshot(m).keys() == before.keys()


def test_build_shortlist_refuses_the_same_folder(rel_dir, copy_of, tmp_path, capsys):
    m = copy_of(rel_dir)
    marker = _evil_folder(m, tmp_path)
    before = snapshot(m)
    rc = main(["build-shortlist", "--model", str(m), "--corpus", str(m / "evil_tok.py"),
               "--out", str(tmp_path / "freq")])
    assert rc == 2 and "auto_map" in capsys.readouterr().err
    assert not marker.exists() and snapshot(m) == before


def test_convert_refuses_a_source_with_custom_code(rel_src, copy_of, tmp_path, capsys):
    src = copy_of(rel_src, "src")
    marker = _evil_folder(src, tmp_path)
    before = snapshot(src)
    rc = main(["convert", str(src), str(tmp_path / "out")])
    assert rc == 2 and "auto_map" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not marker.exists()
    assert snapshot(src) == before


@pytest.mark.parametrize("template, message", [
    # The sandbox forbids dunder access: a template reaching for Python internals.
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "sandbox forbids"),
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
])
def test_chat_template_errors_are_messages(rel_dir, copy_of, capsys, template, message):
    m = copy_of(rel_dir)
    (m / "chat_template.jinja").write_text(template)
    before = snapshot(m)
    target = specjax.load(m)
    with pytest.raises(TokenizerError, match=message):
        specjax.generate(target, "hi", max_new_tokens=1)
    rc = main(["generate", "--model", str(m), "--prompt", "hi", "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "--no-chat" in err and "Traceback" not in err
    # Without the template the same folder works.
    assert main(["generate", "--model", str(m), "--prompt", "hi", "--max-new-tokens", "1",
                 "--no-chat"]) == 0
    assert snapshot(m) == before


def test_a_model_without_a_chat_template_refuses_chat_prompts_by_name(rel_dir, copy_of):
    m = copy_of(rel_dir)
    config = json.loads((m / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (m / "tokenizer_config.json").write_text(json.dumps(config))
    (m / "chat_template.jinja").unlink(missing_ok=True)
    target = specjax.load(m)
    assert target.tokenizer.chat_template is None  # a base model's tokenizer
    with pytest.raises(ValueError, match="no chat template.*chat=False"):
        specjax.generate(target, "hi", max_new_tokens=1)
    assert len(specjax.generate(target, "hi", max_new_tokens=1, chat=False).tokens[0]) == 1


def _from_pretrained_calls(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "from_pretrained"):
            yield node


def test_every_from_pretrained_in_the_package_refuses_remote_code():
    """Static guard: package code calls from_pretrained only with trust_remote_code=False."""
    bad = []
    for folder in ("specjax", "convert", "train", "kernels"):
        for path in (REPO / folder).rglob("*.py"):
            for call in _from_pretrained_calls(path):
                kw = {k.arg: k.value for k in call.keywords}
                value = kw.get("trust_remote_code")
                if not (isinstance(value, ast.Constant) and value.value is False):
                    bad.append(f"{path.relative_to(REPO)}:{call.lineno}")
    assert not bad, f"from_pretrained without trust_remote_code=False: {bad}"
