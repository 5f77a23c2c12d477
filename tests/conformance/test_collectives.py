"""Conformance: every Communicator collective and compressed_allreduce, written once
(collective_bodies.py), run on each backend of the registry at W = 1..4.

One spawn per (backend, W) runs every case (spawning dominates the time); the rank bodies assert
themselves, so a failure comes back as the failing rank's exception and traceback, with the
backend, W, rank and case (collective, dtype, count, op, root, round) in its message.
"""

from __future__ import annotations

import pytest

from _backends import no_cuda_kernels

BODIES = "conformance.collective_bodies"
# compressed_allreduce: (size, rounds with errors carried); the large size once (the rounds are
# what the small sizes check, the large one exercises many blocks and long vectors).
COMPRESSED = {
    "sizes": [(0, 3), (1, 3), (7, 3), (1000, 3), (4099, 3), (2**20 + 3, 1)],
    "dtypes": ["float32", "float16", "bfloat16"],
    "shapes": [(1000, (10, 100)), (4099, (1, 4099))],  # (n, shape): non-flat tensors too
}

pytestmark = pytest.mark.conformance


def test_conformance(backend, world, tmp_path):
    """On ``world`` ranks of ``backend``: all_reduce sum/max/min, reduce_scatter, all_gather (and in
    place), all_to_all, broadcast from every root, over 7 dtypes and counts 0/1/7/1000/4099;
    barrier; bytes_sent; argument errors; compressed_allreduce (fp32/fp16/bf16) against the float64
    numpy oracle (reference.py), its wire bytes and rank-mismatch detection."""
    compressed = COMPRESSED
    if backend.name == "nccl" and no_cuda_kernels():
        compressed = None  # the compressed path on GPU buffers needs compcomm's CUDA kernels
    backend.run(world, f"{BODIES}:suite", str(tmp_path), compressed, timeout=600)
