"""The real Gemma 3 270M (GGUF, 262k vocabulary) against transformers' GGUF load, and
``--model gemma3-270m``. Slow (a 1 GB conversion on first use, transformers' load):
``-m bench`` only."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.bench

PROMPT = "The three primary colours are red, yellow and blue. Mixing red and blue gives"


@pytest.fixture(scope="module")
def gguf_path():
    from specjax.defaults import gemma3_gguf_path

    return gemma3_gguf_path()


@pytest.fixture(scope="module")
def gemma(gguf_path):
    """``--model gemma3-270m``: converted once into the cache dir."""
    import specjax
    from specjax.defaults import GEMMA3_MODEL_NAME, resolve_model

    return specjax.load(resolve_model(GEMMA3_MODEL_NAME))


@pytest.fixture(scope="module")
def gemma_hf(gguf_path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                dtype=torch.float32).eval()


def test_logits_and_32_greedy_tokens_match_transformers(gemma, gemma_hf):
    import jax.numpy as jnp
    import numpy as np
    import torch

    import specjax
    from specjax.model import forward, init_cache

    assert gemma.cfg.vocab_size == 262144 and gemma.cfg.sliding_window == 512
    assert gemma.cfg.layer_types.count("full_attention") == 3  # layers 5, 11, 17 of 18
    ids = gemma.tokenizer.encode(PROMPT)
    with torch.no_grad():
        ref = gemma_hf(torch.tensor([ids])).logits.numpy()
        ref_new = gemma_hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    logits, _ = forward(gemma.params, gemma.cfg, jnp.asarray([ids]), jnp.arange(len(ids))[None],
                        init_cache(gemma.cfg, 1, 64))
    err = np.abs(np.asarray(logits) - ref).max()
    assert err <= 1e-4, f"max |logits - transformers| = {err}"  # measured 3.9e-5
    got = specjax.generate(gemma, [ids], max_new_tokens=32, stop_on_eos=False).tokens[0]
    assert got == ref_new


def test_tokenizer_and_chat_template(gemma, gguf_path):
    """The converted tokenizer is transformers' GGUF tokenizer. The file is the base model
    and carries no chat template, so neither has one, and chat prompts are refused by name."""
    from transformers import AutoTokenizer

    import specjax

    ref = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tok = gemma.tokenizer
    text = "Speculative decoding drafts tokens:  123 ÄÖ 日本 🙂\n\n<start_of_turn>user\nHi"
    assert tok.encode(text) == ref.encode(text) and tok.encode(text)[0] == 2  # <bos>
    assert tok.decode(tok.encode(text)) == ref.decode(ref.encode(text))
    assert tok.chat_template is None and ref.chat_template is None
    assert gemma.eos_ids == (1,)
    with pytest.raises(ValueError, match="no chat template.*--no-chat"):
        specjax.generate(gemma, "Hi", max_new_tokens=2)


def test_cli_drafts_with_the_shipped_drafter_and_refuses_the_smollm2_one(gemma, capsys):
    from specjax.cli import main
    from specjax.defaults import default_drafter_dir

    args = ["generate", "--model", "gemma3-270m", "--no-chat", "--prompt", PROMPT,
            "--max-new-tokens", "16"]
    # No flags: the shipped Gemma drafter with its measured tree and shortlist head; greedy
    # text equal to vanilla's (--vs-vanilla exits 1 otherwise).
    assert main([*args, "--vs-vanilla"]) == 0
    err = capsys.readouterr().err
    assert "tokens per target forward" in err and "same text" in err
    assert main([*args, "--drafter", str(default_drafter_dir())]) == 2
    assert "built for a different target" in capsys.readouterr().err
