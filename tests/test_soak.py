"""Issue 14's soak: >= 2000 compressed allreduces and >= 300 steps of each 1-bit optimizer (W=2,
gloo) leave resident memory flat -- no per-call or per-step leak (workspaces, error buffers,
staging, AsyncComm work handles)."""

from __future__ import annotations

import _soak_cases as C
from compcomm.testing import run_ranks

GROWTH_MIB = 8.0  # allocator noise; a leak of one 16 KiB buffer per call would be 28 MiB


def test_resident_memory_stays_flat():
    for res in run_ranks(2, C.soak, timeout=600):
        assert res["calls_end"] - res["calls_warm"] < GROWTH_MIB, res
        for name in ("adam", "zoadam"):
            assert res[f"{name}_end"] - res[f"{name}_warm"] < GROWTH_MIB, (name, res)
            assert res[f"{name}_skipped"] == 0, (name, res)
