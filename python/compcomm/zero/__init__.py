"""ZeRO stage 1/2/3 on compcomm's bucketed collectives (see :class:`ZeroOptimizer`)."""

from __future__ import annotations

from .checkpoint import consolidate, load_checkpoint, save_checkpoint
from .compressed import compressed_reduce_scatter
from .config import ZERO_DEFAULTS, validate_zero_config
from .entry import initialize
from .memory import estimate_memory
from .optimizer import ZeroOptimizer

__all__ = [
    "ZeroOptimizer",
    "initialize",
    "ZERO_DEFAULTS",
    "validate_zero_config",
    "estimate_memory",
    "save_checkpoint",
    "load_checkpoint",
    "consolidate",
    "compressed_reduce_scatter",
]
