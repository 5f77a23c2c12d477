"""Issue 14's fault injection on gloo: a peer that dies (its process exits) while the others run the
compressed allreduce and a 1-bit optimizer step, at W=2..4 -- the survivors get a typed error
within 2x the timeout, no hang, nothing changed. (A peer that stays alive but silent:
test_compressed_allreduce.py::test_cross_rank_errors; MPI: test_mpi.py; NCCL: test_nccl.py on GPU.)"""

from __future__ import annotations

import pytest

import _fault_cases as C
from compcomm.testing import run_ranks

TYPED = ("CommTimeoutError", "BackendError")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_dead_peer_gives_typed_error_and_changes_nothing(world):
    for rank, res in enumerate(run_ranks(world, C.dead_peer, timeout=120)):
        if rank == world - 1:
            continue
        assert res["allreduce"] in TYPED and res["allreduce_s"] < 2 * C.TIMEOUT, res
        assert res["allreduce_unchanged"], res
        assert res["step"] in TYPED + ("CommError",) and res["step_s"] < 2 * C.TIMEOUT, res
        assert res["step_unchanged"], res
