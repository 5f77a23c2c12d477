"""Checks of JSON config values (DeepSpeed-style configs): each names the key and the value."""

from __future__ import annotations

import numbers
from typing import Any

__all__ = ["number", "flag"]


def number(where: str, v: Any, minimum: float = 0.0, strict: bool = False) -> None:
    """TypeError unless ``v`` is a number; ValueError unless ``v >= minimum`` (``>`` if strict)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{where} must be a number, got {type(v).__name__} {v!r}")
    if not (v > minimum if strict else v >= minimum):  # NaN fails both
        raise ValueError(f"{where} must be {'>' if strict else '>='} {minimum}, got {v!r}")


def flag(where: str, v: Any) -> None:
    """TypeError unless ``v`` is true or false."""
    if not isinstance(v, bool):
        raise TypeError(f"{where} must be true or false, got {v!r}")
