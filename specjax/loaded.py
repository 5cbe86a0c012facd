"""What :func:`specjax.load` and :func:`specjax.load_drafter` return: a target and a drafter.

They live below :mod:`specjax.api` so that the modules the API calls (vocabulary heads,
benchmarks, training) can name them in type hints without importing the API.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from specjax.config import ModelConfig
from specjax.draft_model import DraftModel
from specjax.model import Params
from specjax.tree.default import (
    BatchTrees,
    SampledBatchTrees,
    SampledTrees,
    nearest_temperature,
    sampled_tree_at,
)
from specjax.tree.spec import TreeSpec


@dataclasses.dataclass(frozen=True)
class Target:
    """A loaded target model: what :func:`generate` needs."""

    cfg: ModelConfig
    params: Params
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    path: Path

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: config EOS and the tokenizer's EOS."""
        ids = set(self.cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))


@dataclasses.dataclass(frozen=True)
class Drafter:
    """A loaded drafter, checked against the target it will serve."""

    cfg: DraftModel  # DrafterConfig (EAGLE-1/2) or Eagle3Config
    params: Any  # DrafterParams or Eagle3Params, as cfg says
    path: Path | None = None
    meta: dict | None = None
    # The tree and vocabulary head measured fastest for this drafter (its folder's
    # default_tree.json; see specjax.tree.default): the greedy tree measured on this
    # machine's class where the file stores one, else its main tree; generate uses them
    # when given none. default_vocab is a head spec that reads only the folder's own artifacts;
    # sampled_trees, where the file has them, are the trees measured for sampling, as
    # (temperature, tree) by temperature (specjax.tree.default.sampled_tree_at).
    default_tree: TreeSpec | None = None
    default_vocab: str | None = None
    sampled_trees: SampledTrees = ()
    # The folder's batch defaults (specjax bench batch): (batch size >= 2, the tree fastest
    # there, or None where speculation lost to vanilla decoding), by size; greedy, and
    # where measured apart, for sampling: such tables as (temperature, table) by temperature.
    batch_trees: BatchTrees = ()
    sampled_batch_trees: SampledBatchTrees = ()

    def batch_table_temperature(self, temperature: float) -> float | None:
        """The temperature of the sampled batch table that serves decoding at
        ``temperature`` (:meth:`batch_table`): sampling, the one measured nearest it
        (:func:`~specjax.tree.default.nearest_temperature`) where that table has entries;
        None where the greedy table serves (greedy decoding, or none measured)."""
        _check_temperature(temperature)
        t = nearest_temperature(self.sampled_batch_trees, temperature) if temperature > 0 else None
        return t if t is not None and dict(self.sampled_batch_trees)[t] else None

    def batch_table(self, temperature: float) -> BatchTrees:
        """The batch defaults that serve decoding at ``temperature`` (0: greedy): sampling,
        the table measured at the temperature nearest it where the folder has one
        (:meth:`batch_table_temperature`), else the greedy one."""
        t = self.batch_table_temperature(temperature)
        return self.batch_trees if t is None else dict(self.sampled_batch_trees)[t]

    def _batch_entry(self, batch: int, temperature: float) -> tuple[bool, TreeSpec | None]:
        """(whether a measured size <= ``batch`` exists, its entry): the largest such, except
        above the largest measured size, where a tree was never measured: vanilla decoding
        (None) there. Sizes between measured ones inherit only vanilla decoding (a gap
        below a drafting size is refused when the defaults are written)."""
        table = self.batch_table(temperature)
        found = [t for size, t in table if size <= batch]
        if not found:
            return False, None
        return True, found[-1] if batch <= table[-1][0] else None

    def speculates_at(self, batch: int, temperature: float = 0.0) -> bool:
        """Whether the folder measured speculation worth running at ``batch`` rows when
        decoding at ``temperature`` (0: greedy; :meth:`batch_table`): False where the entry
        for the largest measured size <= ``batch`` is vanilla decoding, and above the
        largest measured size (nothing measured drafts there)."""
        measured, tree = self._batch_entry(batch, temperature)
        return not measured or tree is not None

    def tree_for(self, temperature: float, batch: int = 1) -> TreeSpec:
        """The tree generate drafts when given none at ``temperature`` (0: greedy): at
        ``batch`` >= 2 rows the measured batch default for that size and temperature
        (:meth:`batch_table`; :meth:`speculates_at` says where there is none to draft); at
        one row, sampling, the one measured at the temperature nearest ``temperature`` where
        the folder has one (:func:`~specjax.tree.default.sampled_tree_at`), else the
        measured greedy one, else :class:`TreeSpec`'s defaults (a small EAGLE-2 tree).

        Sampling at a batch drafts the greedy batch trees where the folder measured none
        for sampling: they are the small trees a batch's verify can afford (rows x nodes
        stay under the forward's latency step), where the tree for sampling was measured at
        one row (SmolLM2, 4 rows at temperature 1: its root of five sampled children 0.44x
        vanilla, the batch tree chain d1 + lookup 1 1.08x).
        """
        _, tree = self._batch_entry(batch, temperature)
        if tree is not None:
            return tree
        return ((temperature > 0 and sampled_tree_at(self.sampled_trees, temperature))
                or self.default_tree or TreeSpec())


def _check_temperature(temperature: float) -> None:
    """Refuse a bool where a temperature is due: the older ``tree_for(greedy)`` and
    ``speculates_at(batch, greedy)`` took one, and True would read as temperature 1, False
    as greedy decoding."""
    if isinstance(temperature, bool):
        raise TypeError("this takes the temperature (0 for greedy), not a bool")
