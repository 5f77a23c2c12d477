"""OneBitAdam(overlap_backward=True) over the MPI communicator, a rank body for tests/mpi/runner.py
(2-3 ranks): the groups sent from the backward run on the worker thread's MPI calls while the
backward goes on, and the parameters and error buffers equal those without overlap bit for bit
(fp32, bf16); gradient accumulation switches the overlap off, with the same bits."""

from __future__ import annotations

import torch

import _overlap_cases as C


def run(ctx) -> None:
    C._small_groups()
    for scenario, dtype in (("plain", torch.float32), ("plain", torch.bfloat16),
                            ("accumulate", torch.float32)):
        runs = {o: C.trajectory(ctx.rank, o, scenario, dtype, group=ctx.comm)
                for o in (False, True)}
        where = f"[rank {ctx.rank}] {scenario} {dtype}"
        if not C.identical(runs):
            raise AssertionError(f"{where}: overlap changed the bits")
        on = runs[True]
        if scenario == "plain" and (on["overlapped"] != C.STEPS - C.FREEZE
                                    or on["from_backward"] == 0 or on["warnings"]):
            raise AssertionError(f"{where}: not overlapped: {on['overlapped']} steps, "
                                 f"{on['from_backward']} groups, {on['warnings']}")
        if scenario == "accumulate" and on["enabled"] is not False:
            raise AssertionError(f"{where}: accumulation did not switch the overlap off")
