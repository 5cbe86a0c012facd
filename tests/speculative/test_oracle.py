"""The benchmark-only oracle drafter: proposes the recorded greedy continuation through the
ordinary drafter and vocabulary-head seams, so a chain accepts every draft."""

from __future__ import annotations

import specjax
from specjax.bench.oracle import oracle_drafter, record_head
from specjax.loop import bucket
from specjax.speculative import TreeSpec


def test_oracle_chain_accepts_everything(tiny_target):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    n = 24
    ref = specjax.generate(tiny_target, [prompt], max_new_tokens=n, stop_on_eos=False)
    seq = prompt + ref.tokens[0]
    head = record_head(tiny_target, [seq], bucket(len(seq) + 6))
    drafter = oracle_drafter(tiny_target)
    res = specjax.generate(tiny_target, [prompt], max_new_tokens=n, stop_on_eos=False,
                           drafter=drafter, tree=TreeSpec("chain", depth=3), vocab=head)
    assert res.tokens == ref.tokens
    # Every step commits depth + 1 tokens but the last, which the budget cuts.
    assert all(a == 4 for a in res.stats["accept_lengths"][0][:-1])
