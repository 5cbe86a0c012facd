"""Shared by the FR-Spec tests (test_corpus_counts, test_shortlist): a toy tokenizer and corpus."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

SPECIALS = ["[UNK]", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>"]
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "user", "assistant", "system",
         "hi", "hello"]
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
            "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\n' }}{% endif %}")


def toy_tokenizer(words=WORDS):
    """A word-level fast tokenizer (whitespace split) with ChatML specials; 18 ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS[1:])
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=TEMPLATE,
                                   unk_token="[UNK]", eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def tok():
    return toy_tokenizer()


def hand_count(tok, docs, v):
    """Whitespace words (and the specials, which never touch a word) -> ids; unknown -> 0."""
    vocab = tok.get_vocab()
    c = Counter()
    for d in docs:
        for s in SPECIALS[1:]:
            d = d.replace(s, f" {s} ")
        c.update(vocab.get(w, 0) for w in d.split())
    out = np.zeros(v, np.int64)
    for i, n in c.items():
        out[i] = n
    return out


def toy_docs(n=50, fail_after=None):
    """``n`` deterministic word documents; raises after ``fail_after`` of them (a kill)."""
    words = WORDS[:8] + ["zebra"]
    for i in range(n):
        if fail_after is not None and i == fail_after:
            raise RuntimeError("interrupted")
        yield " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(i % 6 + 1))


@pytest.fixture(scope="module")
def model_dir(tok, tmp_path_factory):
    """A converted-target stand-in: a manifest (no tensors are read) and tokenizer files."""
    from specjax.checkpoint import FORMAT, MANIFEST, VERSION
    from specjax.config import ModelConfig

    d = tmp_path_factory.mktemp("model")
    cfg = ModelConfig(model_type="llama", vocab_size=32, hidden_size=8, intermediate_size=8,
                      num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5,
                      rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=True,
                      eos_token_ids=(1,))
    (d / MANIFEST).write_text(json.dumps({"format": FORMAT, "version": VERSION,
                                          "config": cfg.to_json()}))
    tok.save_pretrained(d)
    return d
