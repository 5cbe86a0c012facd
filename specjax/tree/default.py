"""A drafter's measured default tree: ``<drafter>/default_tree.json``.

The fastest lossless tree depends on the drafter's acceptance and on the hardware's target
latency curve, so it is measured (``specjax bench spec --save-default-tree``, Sequoia's
way: calibration MAL / (verify(T) + draft time)) and stored beside the drafter with how it
was measured. ``specjax.generate`` and ``specjax generate`` use it when no tree is given;
a drafter without the file gets :class:`TreeSpec`'s defaults.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specjax.checkpoint import write_json_atomic
from specjax.tree.spec import TreeSpec

FILE = "default_tree.json"
FORMAT = "specjax-default-tree"


def read_default_tree(folder: str | Path) -> TreeSpec | None:
    """The tree stored in ``folder`` (None when it has none).

    Raises:
      ValueError: the file exists but is not a valid default tree (names the file and how
        to fix it).
    """
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT!r} file")
        return TreeSpec.from_json(d["tree"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a valid default tree ({e}); delete it to use "
                         "TreeSpec's defaults, or measure one again with `specjax bench spec "
                         "--save-default-tree`") from None


def write_default_tree(folder: str | Path, tree: TreeSpec, measured: dict[str, Any]) -> Path:
    """Store ``tree`` as ``folder``'s default, with ``measured`` (how it was chosen)."""
    path = Path(folder) / FILE
    write_json_atomic(path, {"format": FORMAT, "tree": tree.to_json(), "measured": measured})
    return path
