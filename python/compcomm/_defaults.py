"""Defaults every layer shares (the bottom layer: imports nothing of compcomm)."""

from __future__ import annotations

__all__ = ["DEFAULT_TIMEOUT"]

#: Seconds a collective waits for its peers before raising CommTimeoutError.
DEFAULT_TIMEOUT = 600.0
