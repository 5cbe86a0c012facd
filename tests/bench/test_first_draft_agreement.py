"""examples/first_draft_agreement.py's split of a drafter's hits by where the target copies."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

_SCRIPT = Path(__file__).parents[2] / "examples" / "first_draft_agreement.py"
_spec = importlib.util.spec_from_file_location("first_draft_agreement", _SCRIPT)
fda = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fda)


def test_split_by_lookup_pools_each_kind_of_position_per_task():
    b = lambda *v: np.asarray(v, bool)  # noqa: E731
    hits = [b(1, 0, 1, 1), b(0, 0), b()]  # the third answer stopped at once
    look = [b(1, 1, 0, 0), b(1, 0), b()]
    got = fda.split_by_lookup(hits, look, ["qa", "rag", "qa"], ("qa", "rag", "math"))
    hit, miss = got["where_lookup_hits"], got["where_lookup_misses"]
    # Lookup right at 3 of 6 positions; the drafter is right at 1 of those, 2 of the rest.
    assert hit["share"] == pytest.approx(0.5) and miss["share"] == pytest.approx(0.5)
    assert hit["pooled"] == pytest.approx(1 / 3) and miss["pooled"] == pytest.approx(2 / 3)
    assert hit["per_task"] == {"qa": pytest.approx(0.5), "rag": 0.0, "math": None}
    assert miss["per_task"] == {"qa": 1.0, "rag": 0.0, "math": None}
    # The two parts partition the positions: their pooled hits add back to the whole.
    assert (hit["pooled"] * hit["share"] + miss["pooled"] * miss["share"]
            == pytest.approx(fda.pooled(hits)))
