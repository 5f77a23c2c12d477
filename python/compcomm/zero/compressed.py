"""The 1-bit compressed reduce-scatter used to reduce momentum shards under ZeRO: it lives in
:mod:`compcomm.collectives` next to the compressed allreduce (one validation for both) and is
re-exported here under its old name."""

from __future__ import annotations

from ..collectives import compressed_reduce_scatter

__all__ = ["compressed_reduce_scatter"]
