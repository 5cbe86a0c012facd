"""Loading a checkpoint folder's tokenizer without ever running code from the folder.

transformers' ``AutoTokenizer`` imports and runs Python files from a model folder when its
``tokenizer_config.json`` or ``config.json`` has an ``auto_map`` (and asks ``[y/N]`` on a
terminal when ``trust_remote_code`` is not given). specjax treats every folder as untrusted:

* :func:`check_folder` refuses a folder whose ``tokenizer_config.json`` or ``config.json``
  has an ``auto_map``, or names a ``tokenizer_class`` that is not one of transformers' own
  tokenizer classes, with a message naming the file and the field;
* :func:`load_tokenizer` then loads it with ``trust_remote_code=False`` and
  ``local_files_only=True`` (never a prompt, never the network), and turns malformed
  tokenizer files into a :class:`TokenizerError` that names the file;
* :func:`render_chat` applies the chat template, turning template errors (a sandbox
  violation included: templates run in jinja2's sandbox) into a :class:`TokenizerError`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The JSON files transformers reads from a tokenizer folder, parsed here first so that a
# syntax error names its file instead of surfacing as a bare decoder message.
JSON_FILES = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json",
              "config.json", "generation_config.json")
# tokenizer_class values that are transformers' generic backends (not "*Tokenizer[Fast]").
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast", "PythonBackend",
                    "PreTrainedTokenizer")


class TokenizerError(ValueError):
    """A folder's tokenizer is refused (code, unknown class) or cannot be read."""


def has_tokenizer(path: str | Path) -> bool:
    """Whether ``path`` carries tokenizer files (converted folders copy them from the source)."""
    path = Path(path)
    return (path / "tokenizer_config.json").exists() or (path / "tokenizer.json").exists()


def read_json(path: Path) -> Any:
    """``json.loads`` of a file, with a message naming the file when it is not JSON."""
    try:
        return json.loads(Path(path).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path} is not valid JSON ({e}); fix the file or restore it from "
                             "the original checkpoint") from e


def _known_tokenizer_class(name: str) -> bool:
    """Whether ``name`` is a tokenizer class that transformers itself defines."""
    from transformers import PreTrainedTokenizerBase
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    # Only tokenizer-looking names are resolved: resolving e.g. "LlamaForCausalLM" would
    # import a modeling module (and torch) just to refuse it.
    if name not in _GENERIC_CLASSES and not name.removesuffix("Fast").endswith("Tokenizer"):
        return False
    try:
        cls = tokenizer_class_from_name(name)
    except Exception:  # noqa: BLE001 - an import failure inside transformers means "unknown"
        return False
    return (isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase)
            and cls.__module__.startswith("transformers."))


def check_folder(path: str | Path) -> None:
    """Refuse a folder that would make transformers run code from it, naming the field.

    Checks ``tokenizer_config.json`` and ``config.json``: an ``auto_map`` (custom code to
    import) or a ``tokenizer_class`` that transformers does not define is refused. Also
    refuses files that are not valid JSON.
    """
    path = Path(path)
    for name in ("tokenizer_config.json", "config.json"):
        file = path / name
        if not file.exists():
            continue
        data = read_json(file)
        if not isinstance(data, dict):
            raise TokenizerError(f"{file} holds a JSON {type(data).__name__}, not an object; "
                                 "restore the file from the original checkpoint")
        if "auto_map" in data:
            raise TokenizerError(
                f"{file} has an \"auto_map\" field, which asks to run Python code shipped in "
                f"the folder ({_shown_map(data['auto_map'])}); specjax never runs code from a "
                "checkpoint. Remove the field if the model works with transformers' own "
                "classes, or use a checkpoint without custom code")
        cls = data.get("tokenizer_class")
        if cls is None:
            continue
        if not isinstance(cls, str) or not _known_tokenizer_class(cls):
            raise TokenizerError(
                f"{file} has \"tokenizer_class\": {json.dumps(cls)}, which is not a tokenizer "
                "class of transformers; specjax only loads transformers' own tokenizers (e.g. "
                "\"TokenizersBackend\" or \"PreTrainedTokenizerFast\" for a tokenizer.json)")


def _shown_map(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def load_tokenizer(path: str | Path) -> Any | None:
    """The tokenizer of a checkpoint folder, or None when it has no tokenizer files.

    Raises:
      TokenizerError: the folder asks to run code (:func:`check_folder`), or a tokenizer
        file is malformed (the message names it).
    """
    path = Path(path)
    if not has_tokenizer(path):
        return None
    check_folder(path)
    for name in JSON_FILES:
        if (path / name).exists():
            read_json(path / name)
    from transformers import AutoTokenizer

    try:
        # check_folder leaves AutoTokenizer no dynamic path to take; trust_remote_code=False
        # makes sure it would refuse one rather than prompt, and local_files_only keeps it
        # off the network.
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False,
                                             local_files_only=True)
    except Exception as e:  # tokenizers' Rust errors carry no useful type; name the folder.
        raise TokenizerError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {e}); "
                             "restore the tokenizer files from the original checkpoint or "
                             "convert it again") from e


def render_chat(tokenizer: Any, messages: list[dict[str, str]], *, where: str = "the model",
                **kwargs: Any) -> Any:
    """``tokenizer.apply_chat_template(messages, **kwargs)`` with template errors explained.

    Chat templates are jinja2 run in transformers' sandbox, so a template cannot run code;
    one that tries (a SecurityError) or that fails for another reason (a TemplateError, e.g.
    ``raise_exception`` on an unsupported role) is reported as a :class:`TokenizerError`.
    """
    import jinja2

    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except jinja2.exceptions.SecurityError as e:
        raise TokenizerError(
            f"the chat template of {where} tried something its sandbox forbids ({e}); the "
            "template is broken or malicious: fix chat_template (tokenizer_config.json or "
            "chat_template.jinja) or pass chat=False (--no-chat)") from e
    except jinja2.exceptions.TemplateError as e:
        raise TokenizerError(
            f"the chat template of {where} failed ({type(e).__name__}: {e}); fix "
            "chat_template (tokenizer_config.json or chat_template.jinja) or pass chat=False "
            "(--no-chat)") from e
