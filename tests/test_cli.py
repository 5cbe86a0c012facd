"""The `specjax` command line, run as a user would."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from specjax import cli
from specjax.cli import main


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specjax.cli", *args], capture_output=True,
                          text=True, timeout=600)


def test_generate_json(smollm2_dir):
    r = _cli("generate", "--model", str(smollm2_dir), "--prompt", "Name a colour.",
             "--max-new-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"text", "tokens", "stats"}
    assert isinstance(out["text"], str) and 1 <= len(out["tokens"]) <= 8
    assert {"new_tokens", "wall_s", "tokens_per_s"} <= set(out["stats"])


def test_convert_refusals_are_one_line_errors(tmp_path, tiny_llama, capsys):
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "out").mkdir()
    assert main(["convert", str(tiny_llama), str(tmp_path / "out")]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["convert", str(tiny_llama), str(tmp_path / "out"), "--overwrite"]) == 0


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--max-new-tokens", "9000"], "exceeds the model's context"),
    (["--stream", "--json"], "--stream prints one prompt's text"),
    (["--stream", "--prompt", "two"], "--stream prints one prompt's text"),
    (["--stream", "--vs-vanilla"], "--vs-vanilla times two full runs"),
])
def test_generate_bad_input(smollm2_dir, capsys, args, message):
    assert main(["generate", "--model", str(smollm2_dir), "--prompt", "hi", *args]) == 2
    assert message in capsys.readouterr().err


def test_generate_missing_model(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"]) == 2
    assert "specjax convert" in capsys.readouterr().err


def test_generate_stream_prints_what_generate_returns(smollm2_dir, capsys):
    """--stream runs the step from Python; its text is the compiled run's, speculative too."""
    from specjax.defaults import default_drafter_dir

    args = ["generate", "--model", str(smollm2_dir), "--prompt", "Name a colour.",
            "--max-new-tokens", "12", "--drafter", str(default_drafter_dir()), "--tree", "chain",
            "--tree-depth", "2"]
    assert main([*args, "--json"]) == 0
    want = json.loads(capsys.readouterr().out)["text"]
    assert main([*args, "--stream"]) == 0
    assert capsys.readouterr().out == want + "\n"
    # --vs-vanilla: the same prompt without the drafter, its speed and the same text.
    assert main([*args, "--vs-vanilla"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == want.strip()
    assert "vanilla" in out.err and "x, same text]" in out.err


def test_env_reports_backend_versions_and_caches(capsys, monkeypatch, tmp_path):
    """`specjax env`: what a bug report needs, as text and as JSON, from the live process."""
    import jax

    monkeypatch.setenv("SPECJAX_HOME", str(tmp_path))
    monkeypatch.delenv("SPECJAX_JAX_CACHE", raising=False)
    assert main(["env", "--json"]) == 0
    env = json.loads(capsys.readouterr().out)
    assert env["backend"] == jax.default_backend()
    assert env["machine_class"] in ("cpu", "cpu-avx2", "cpu-avx512f")  # the suite runs on CPU
    assert len(env["devices"]) == jax.device_count()
    assert env["versions"]["jax"] == jax.__version__
    assert env["caches"] == {"specjax_home": str(tmp_path),
                             "jax_compilation_cache": str(tmp_path / "jax-cache")}
    assert env["env"]["SPECJAX_HOME"] == str(tmp_path)
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert f"backend: {jax.default_backend()} (machine class {env['machine_class']})" in text
    assert f"  jax: {jax.__version__}" in text


def _main_running(monkeypatch, run):
    """``main`` with one command, ``probe``, whose ``run`` is ``run``."""
    def parser():
        p = argparse.ArgumentParser(prog="specjax")
        sub = p.add_subparsers(dest="command", required=True)
        probe = sub.add_parser("probe")
        probe.add_argument("--rate", type=float, default=1.0)
        probe.set_defaults(run=run)
        return p

    monkeypatch.setattr(cli, "build_parser", parser)


@pytest.mark.parametrize("error, code, message", [
    (ValueError("the shortlist omits EOS"), 2, "specjax probe: error: the shortlist omits EOS"),
    (FileNotFoundError("no such model folder"), 2, "specjax probe: error: no such model folder"),
    (PermissionError(13, "Permission denied", "/ro/out"), 1,
     "specjax probe: error: Permission denied: /ro/out"),
    (KeyboardInterrupt(), 130, "specjax probe: interrupted"),
])
def test_main_turns_refusals_into_one_line_and_an_exit_code(monkeypatch, capsys, error, code,
                                                             message):
    def run(args):
        raise error

    _main_running(monkeypatch, run)
    assert cli.main(["probe"]) == code
    assert capsys.readouterr().err.strip() == message


def test_main_names_a_failing_chat_template_and_lets_bugs_through(monkeypatch, capsys):
    import jinja2

    def template(args):
        jinja2.Environment().from_string("{{ messages[0]['content'] }}").render(messages=[])

    _main_running(monkeypatch, template)
    assert cli.main(["probe"]) == 2
    err = capsys.readouterr().err
    assert "the chat template failed (UndefinedError" in err and "chat_template" in err

    def bug(args):
        raise ZeroDivisionError("a bug")

    _main_running(monkeypatch, bug)
    with pytest.raises(ZeroDivisionError):  # not dressed up as bad input
        cli.main(["probe"])


def test_float_flags_refuse_words_and_non_finite_numbers(monkeypatch, capsys):
    _main_running(monkeypatch, lambda args: 0 if args.rate == 0.5 else 3)
    assert cli.main(["probe", "--rate", "0.5"]) == 0
    assert cli.main(["probe", "--rate", "fast"]) == 2
    assert "expected a number, got 'fast'" in capsys.readouterr().err
    assert cli.main(["probe", "--rate", "nan"]) == 2
    assert "must be a finite number, got 'nan'" in capsys.readouterr().err
