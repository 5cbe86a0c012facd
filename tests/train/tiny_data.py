"""The tiny target, sequences and hidden-state cache that the drafter-training tests share."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

import specjax
from specjax.loaded import Target
from specjax.train.data import Example, cache_hidden_states
from tests.tiny import make_hf_checkpoint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

MAX_LEN = 32


def scaled_target(root: Path) -> Target:
    """The tiny random Llama with its embedding and LM head scaled up.

    At HF's init scale (std 0.02) the final-norm states are nearly a fixed
    rescaling of the embedding and the teacher distribution is almost uniform,
    so neither loss term has much to learn in a few dozen steps. Larger
    embeddings and head give peaked teachers, like a trained model's.
    """
    src = make_hf_checkpoint(root / "hf", "llama")
    t = specjax.load(specjax.convert(src, root / "specjax", progress=False))
    params = dataclasses.replace(t.params, embed=t.params.embed * 50,
                                 lm_head=t.params.lm_head * 50)
    return dataclasses.replace(t, params=params)


def sequences(n: int = 24, seed: int = 0) -> list[Example]:
    """Pre-tokenised sequences (the tiny target has no tokenizer) with a learnable pattern:
    arithmetic runs of 18..MAX_LEN ids, the last two thirds an assistant's."""
    rs = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        length = int(rs.randint(18, MAX_LEN + 1))
        start, step = rs.randint(3, 200), rs.randint(1, 5)
        toks = (start + step * np.arange(length)) % 256
        asst = np.zeros(length, bool)
        asst[length // 3:] = True
        out.append(Example(toks.astype(np.int32), asst))
    return out


def hidden_cache(target: Target, d: Path) -> Path:
    """:func:`sequences`' hidden states cached in ``d`` (a fifth held out, float32)."""
    cache_hidden_states(target.cfg, target.params, sequences(), d, heldout_fraction=0.2,
                        token_budget=128, batches_per_shard=2, hidden_dtype="float32",
                        progress=False)
    return d


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer with a ChatML template (ids < 256)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2} | {c: i + 3 for i, c in
                                                                enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
                "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
                "{{ '<|im_start|>assistant\n' }}{% endif %}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template,
                                   unk_token="[UNK]")
