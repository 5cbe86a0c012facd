"""Draft trees: the fixed-shape :class:`DraftTree`, its builders, and :class:`TreeSpec`.

Each builder lives in its own module and registers itself (see :mod:`specjax.tree.spec`);
adding a tree means adding a module and one import line here.
"""

from specjax.tree.base import (
    DraftTree,
    ExpandFn,
    ancestors_from_parent,
    pack_ancestors,
    tree_positions,
    unpack_ancestors,
)

# Builders register themselves on import.
from specjax.tree.chain import build_chain  # noqa: E402, I001
from specjax.tree.dyspec import build_dyspec, build_dyspec_threshold  # noqa: E402
from specjax.tree.eagle2 import build_eagle2, eagle2_sizes  # noqa: E402
from specjax.tree.order import bfs_order, dfs_order, mask_blocks, permute_nodes  # noqa: E402
from specjax.tree.spec import BUILDERS, TreeBuilder, TreeSpec, register
from specjax.tree.static import build_static, normalize_paths  # noqa: E402

__all__ = ["BUILDERS", "DraftTree", "ExpandFn", "TreeBuilder", "TreeSpec", "ancestors_from_parent",
           "bfs_order", "build_chain", "build_dyspec", "build_dyspec_threshold", "build_eagle2",
           "build_static", "dfs_order", "eagle2_sizes", "mask_blocks", "normalize_paths",
           "pack_ancestors", "permute_nodes", "register", "tree_positions", "unpack_ancestors"]
