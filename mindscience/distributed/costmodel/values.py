"""Checks of single values shared by the cost model's specs (pure; each raises :class:`ModelError`)."""

from __future__ import annotations

import math

from .errors import ModelError


def _positive_int(name: str, value, minimum: int = 1) -> None:
    # bool is an int subclass: `num_layers: true` must not pass as 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelError(
            f"{name}={value!r} is invalid: expected an integer >= {minimum}. Set {name} to the "
            "model's real value."
        )


def is_finite_number(value) -> bool:
    """An int or float (not a bool) that is neither infinite nor NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ModelError(f"{name}={value!r} is invalid: expected one of {', '.join(choices)}.")
