"""Benchmarks of compcomm's compressed allreduce against plain collectives on network profiles.

``compcomm-bench`` (:mod:`compcomm.bench.cli`) runs sweeps on network namespaces shaped with ``tc tbf``
(:mod:`compcomm.bench.netns`), writes nccl-tests-style tables, plots, and fits a cost model
(:mod:`compcomm.bench.model`) that projects the result onto clusters.
"""

__all__ = ["cli", "model", "netns", "runner", "sweep_report", "train", "train_rank", "train_report",
           "train_setups", "worker"]
