"""``specjax.stream``: the same step as the compiled loop, driven from a Python generator."""

from __future__ import annotations

import dataclasses

import pytest

import specjax
from tests.speculative.conftest import PROMPTS


class ByteTokenizer:
    """Ids 0..255 decode to raw bytes, so one character can span two tokens (é = c3 a9)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("speculative", [False, True], ids=["vanilla", "speculative"])
def test_stream_equals_compiled(tiny_target, fitted_drafter, speculative):
    kw = dict(max_new_tokens=40, stop_on_eos=False)
    if speculative:
        kw |= dict(drafter=fitted_drafter, tree=specjax.TreeSpec("chain", depth=3))
    for prompt in PROMPTS:
        want = specjax.generate(tiny_target, [prompt], **kw)
        chunks = list(specjax.stream(tiny_target, prompt, **kw))
        assert [t for c in chunks for t in c.tokens] == want.tokens[0]
        if speculative:  # one chunk for the prefill's token, then one per target forward
            assert len(chunks) == 1 + want.stats["target_forwards"]
            assert max(len(c.tokens) for c in chunks) > 1
        else:
            assert all(len(c.tokens) == 1 for c in chunks)


def test_stream_holds_back_a_split_character(tiny_target):
    target = dataclasses.replace(tiny_target, tokenizer=ByteTokenizer())
    # The tiny target's ids are arbitrary bytes: lead bytes of multi-byte characters come
    # up, and a chunk ending in one must wait for the next token.
    chunks = list(specjax.stream(target, [0xC3, 0xA9, 65], max_new_tokens=24,
                                 stop_on_eos=False))
    tokens = [t for c in chunks for t in c.tokens]
    full = ByteTokenizer().decode(tokens)
    assert "".join(c.text for c in chunks) == full
    for c in chunks[:-1]:  # only the last chunk may end in an undecodable byte
        assert not c.text.endswith("\ufffd")


def test_stream_refuses_a_batch(tiny_target):
    with pytest.raises(TypeError, match="one prompt"):
        next(specjax.stream(tiny_target, ["a", "b"]))
    with pytest.raises(TypeError, match="one prompt"):
        next(specjax.stream(tiny_target, [[1, 2], [3]]))
