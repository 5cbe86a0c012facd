"""Checkpoint conversion: ``specjax convert SRC OUT``.

Installed as ``specjax.convert`` (the top-level ``convert/`` folder is mapped
onto it by ``pyproject.toml``).
"""

from specjax.convert.dispatch import convert

__all__ = ["convert"]
