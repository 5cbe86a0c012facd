"""examples/lookup_candidates.py: the chain anchored on the first draft, and its counts."""

import importlib.util
import json
import sys
from pathlib import Path

_SCRIPT = Path(__file__).parents[2] / "examples" / "lookup_candidates.py"
_spec = importlib.util.spec_from_file_location("lookup_candidates", _SCRIPT)
lc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lc)

#       0  1  2  3  4  5  6  7  8  9  10
TEXT = [7, 9, 1, 2, 3, 4, 5, 7, 9, 1, 2]


def test_anchored_chain_continues_the_draft_from_the_context():
    # At t = 7 (token 7) the suffix "5 7" has no earlier occurrence and "7" one token only:
    # no root chain. With the right draft 9, "7 9" occurred at 0-1: the chain continues
    # from 2 up to the context's end (index 7).
    assert lc.occurrences(TEXT[:8], 3)[0] == 1
    assert lc.anchored_chain(TEXT, 7, 3, 2, 8) == [1, 2, 3, 4, 5, 7]
    assert lc.anchored_chain(TEXT, 7, 3, 2, 3) == [1, 2, 3]
    assert lc.anchored_chain(TEXT, 7, 3, 3, 8) is None  # "5 7 9" never occurred
    # At t = 4 (token 3), "3 4" occurs nowhere before: nothing to anchor on.
    assert lc.anchored_chain(TEXT, 4, 3, 2, 8) is None


def test_an_occurrence_ending_at_the_context_end_is_not_a_continuation():
    # At t = 2 the suffix with the draft is "1 1" (indices 2-3); its only earlier "1 1"
    # ends at 2, the context's end, and would continue from the draft's own position.
    text = [5, 1, 1, 1, 1]
    assert lc.anchored_chain(text, 2, 3, 2, 8) is None
    # At t = 3, "1 1" ending at 2 continues from 3, the context's last token.
    assert lc.anchored_chain(text, 3, 3, 2, 8) == [1]


def test_main_counts_anchored_chains(tmp_path, monkeypatch, capsys):
    answers = tmp_path / "answers.json"
    answers.write_text(json.dumps({"prompts": [TEXT[:7]], "answers": [TEXT[7:]]}))
    monkeypatch.setattr(sys, "argv", ["lookup_candidates.py", "--answers", str(answers)])
    lc.main()
    out = capsys.readouterr().out
    # Positions t = 7, 8, 9: t = 7 has no root chain and anchors (its chain's first two
    # tokens, 1 2, are right); t = 8 and 9 match the root ("7 9", "7 9 1").
    assert "3 answer positions; suffix matched >= 2: 2 (0.667)" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("no chain"))
    assert line == ("no chain (0.333 of positions): a chain anchored on the right first draft "
                    "found at 1.000 of them, accepted 2.00 tokens after the draft; 0.667 tokens "
                    "a position at most")
