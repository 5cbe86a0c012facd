"""Argument checks shared by the Python API and the command line.

Each check returns the value (normalised to a plain Python type) or raises a
``TypeError`` / ``ValueError`` whose message names the argument, says what was
given and what is accepted. They are pure functions, so the CLI's argparse types
and the API's keyword checks give the same answer for the same value.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

# jax.random.PRNGKey takes a signed 64-bit seed; anything outside overflows in C.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _hint(hint: str) -> str:
    return f" ({hint})" if hint else ""


def check_int(name: str, value: Any, *, minimum: int | None = None,
              maximum: int | None = None, hint: str = "") -> int:
    """``value`` as an ``int``; refuses bools, floats (even 4.0), strings and out-of-range values.

    Numpy integers are accepted: they are what array code hands around.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {_shown(value)}"
                        + _hint(hint))
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}" + _hint(hint))
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}" + _hint(hint))
    return value


def check_real(name: str, value: Any, *, minimum: float | None = None,
               maximum: float | None = None, open_min: bool = False, hint: str = "") -> float:
    """``value`` as a finite ``float``; refuses bools, strings, NaN and +-inf.

    ``open_min`` makes ``minimum`` exclusive (top_p must be > 0).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {_shown(value)}"
                        + _hint(hint))
    try:
        as_float = float(value)
    except OverflowError:  # an int beyond float range (10**400)
        as_float = math.inf
    if not math.isfinite(as_float):
        raise ValueError(f"{name} must be a finite number, got {_shown(value)}" + _hint(hint))
    value = as_float
    low_bad = minimum is not None and (value <= minimum if open_min else value < minimum)
    if low_bad or (maximum is not None and value > maximum):
        if minimum is not None and maximum is not None:
            rng = f"in {'(' if open_min else '['}{minimum:g}, {maximum:g}]"
        elif minimum is not None:
            rng = f"> {minimum:g}" if open_min else f">= {minimum:g}"
        else:
            rng = f"<= {maximum:g}"
        raise ValueError(f"{name} must be {rng}, got {value:g}" + _hint(hint))
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool (numpy bools too); ints and strings are refused."""
    if isinstance(value, bool):
        return value
    if type(value).__name__ == "bool_":  # numpy.bool_ without importing numpy here
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {type(value).__name__} {_shown(value)}")


def check_text(name: str, value: Any) -> str:
    """``value`` if it is a ``str`` that encodes as UTF-8.

    A lone surrogate (``"\\udcff"``) is what Python makes of bytes that are not UTF-8 on the
    command line; no tokenizer can encode it, so it is refused here with its position.
    """
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__} {_shown(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = value[e.start]
        raise ValueError(
            f"{name} is not valid UTF-8 text: character {e.start} is U+{ord(bad):04X}, a lone "
            "surrogate (bytes that are not UTF-8, e.g. from a file or terminal in another "
            "encoding); re-encode the text as UTF-8") from None
    return value


def check_seed(name: str, value: Any) -> int:
    """A PRNG seed: any int that fits jax's signed 64-bit seed."""
    return check_int(name, value, minimum=SEED_MIN, maximum=SEED_MAX,
                     hint="it must fit a signed 64-bit integer, e.g. seed % 2**63")
