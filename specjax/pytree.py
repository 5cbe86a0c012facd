"""One way to declare a pytree: a frozen dataclass whose fields are leaves unless static.

Every carried structure in specjax (weights, caches, loop states, vocabulary heads, draft
trees) is declared with :func:`dataclass`; a field marked :func:`static_field` is jit-static
metadata (hashed into the compiled program, e.g. a budget or a capacity), every other field
is a child that ``jax.jit`` traces. ``ClassVar`` attributes are neither.

    @pytree.dataclass
    class Head:
        ids: Array                          # a leaf
        k_max: int = pytree.static_field()  # part of the program
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax

T = TypeVar("T")
_STATIC = "specjax.static"


def static_field(**kwargs: Any) -> Any:
    """A dataclass field that is static metadata of the pytree (hashable, never traced)."""
    return dataclasses.field(metadata={_STATIC: True}, **kwargs)


def dataclass(cls: type[T]) -> type[T]:
    """``cls`` as a frozen dataclass registered with JAX; fields are leaves unless static."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    return jax.tree_util.register_dataclass(
        cls, data_fields=[f.name for f in fields if not f.metadata.get(_STATIC)],
        meta_fields=[f.name for f in fields if f.metadata.get(_STATIC)])
