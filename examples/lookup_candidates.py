"""Would a second lookup chain pay? The lookup draft (``specjax.tree.lookup``) copies what
followed the *latest* earlier occurrence of the longest suffix; this counts, over the
target's greedy answers, how often another occurrence's continuation would have been right
where that one was not.

For every answer position whose suffix matched >= ``--min-match`` tokens (the shipped
gate), with the suffix up to ``--ngram`` tokens: whether the latest occurrence's next token
is the target's, the most frequent next token among the longest-match occurrences, either
of the two latest *distinct* next tokens; and the leading run of an ``--length``-token chain
the target would accept, from the latest occurrence or the better of the two distinct ones.

Where the suffix matched fewer tokens (no chain is grafted), it also bounds a chain
*anchored on the first draft*: the lookup run again on the context plus the target's own
next token (an oracle drafter's first draft), counting how often that finds a match of
``--min-match`` tokens whose continuation lies in the context, and how much of it the target
would accept after that token. A tree would hang such a chain below its drafted child; the
oracle's figure is the most it could add.

The prompts are ShareGPT's calibration range (``calibration_prompts``, never Spec-Bench);
the answers (greedy, 128 tokens, EOS stops) are cached in ``--answers``.

    python examples/lookup_candidates.py --prompts 48 --answers results/calib_answers.json
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from specjax.bench.decode import leading_agreement


def answers(path: Path, n: int) -> tuple[list[list[int]], list[list[int]]]:
    if not path.is_file():
        import specjax
        from specjax.bench.questions import calibration_prompts
        from specjax.defaults import resolve_model, shipped_drafter_for

        target = specjax.load(resolve_model(None, progress=False))
        drafter = specjax.load_drafter(shipped_drafter_for(target.cfg), target)
        ids, _ = calibration_prompts(target, num=n)
        res = specjax.generate(target, ids, max_new_tokens=128, drafter=drafter)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"prompts": ids, "answers": res.tokens}))
    d = json.loads(path.read_text())
    return d["prompts"], d["answers"]


def occurrences(hist: list[int], ngram: int, stop: int | None = None) -> tuple[int, list[int]]:
    """(longest suffix match m, the ends j < ``stop`` (default len - 1) of every occurrence
    matching m tokens, latest last)."""
    last, best, ends = len(hist) - 1, 0, []
    for j in range(last if stop is None else stop):
        m = 0
        while m < ngram and j - m >= 0 and hist[j - m] == hist[last - m]:
            m += 1
        if m > best:
            best, ends = m, [j]
        elif m == best and m > 0:
            ends.append(j)
    return best, ends


def anchored_chain(text: list[int], t: int, ngram: int, min_match: int,
                   length: int) -> list[int] | None:
    """The chain a lookup anchored on the right first draft would hang below it at position
    ``t``: the context is ``text[:t + 1]``, the draft ``text[t + 1]``; a match of >=
    ``min_match`` tokens ending at j < t continues from ``text[j + 1]``, cut at the context's
    end. None without such a match."""
    m, ends = occurrences(text[:t + 2], ngram, stop=t)
    if m < min_match:
        return None
    j = ends[-1]
    return text[j + 1:min(j + 1 + length, t + 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--answers", default="results/calib_answers.json")
    ap.add_argument("--ngram", type=int, default=3)
    ap.add_argument("--min-match", type=int, default=2)
    ap.add_argument("--length", type=int, default=8)
    args = ap.parse_args()
    prompts, outs = answers(Path(args.answers), args.prompts)
    n = matched = 0
    hits = collections.Counter()
    runs = collections.Counter()
    anchored = anchored_run = 0
    for p, a in zip(prompts, outs, strict=True):
        text = list(p) + list(a)
        for t in range(len(p), len(text) - 1):
            n += 1
            m, ends = occurrences(text[:t + 1], args.ngram)
            if m < args.min_match:
                chain = anchored_chain(text, t, args.ngram, args.min_match, args.length)
                if chain is not None:
                    anchored += 1
                    anchored_run += leading_agreement(chain, text[t + 2:t + 2 + args.length])
                continue
            matched += 1
            truth = text[t + 1:t + 1 + args.length]
            chains = [text[j + 1:j + 1 + args.length] for j in reversed(ends)]  # latest first
            distinct = []  # the two latest occurrences with different next tokens
            for c in chains:
                if len(distinct) < 2 and all(c[0] != d[0] for d in distinct):
                    distinct.append(c)
            hits["latest"] += chains[0][0] == truth[0]
            common = collections.Counter(c[0] for c in chains).most_common(1)[0][0]
            hits["most frequent"] += common == truth[0]
            hits["either of two distinct"] += any(c[0] == truth[0] for c in distinct)
            runs["latest"] += leading_agreement(chains[0], truth)
            runs["better of two distinct"] += max(leading_agreement(c, truth) for c in distinct)
    print(f"{n} answer positions; suffix matched >= {args.min_match}: {matched} "
          f"({matched / n:.3f})")
    for k, v in hits.items():
        print(f"next token right, {k:<24} {v / matched:.3f}")
    for k, v in runs.items():
        print(f"chain of {args.length} accepted, {k:<22} {v / matched:.3f} tokens")
    unmatched = n - matched
    print(f"no chain ({unmatched / n:.3f} of positions): a chain anchored on the right first draft "
          f"found at {anchored / max(unmatched, 1):.3f} of them, accepted "
          f"{anchored_run / max(anchored, 1):.2f} tokens after the draft; "
          f"{anchored_run / n:.3f} tokens a position at most")


if __name__ == "__main__":
    main()
