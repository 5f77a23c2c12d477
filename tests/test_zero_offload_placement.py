"""ZeRO-Offload with OneBitAdam: where a bucket's 1-bit work runs (``onebit_placement``).

"device" (default): compression on the parameters' device, only the 1-bit form of this rank's
momentum chunk copied to the host shard; "host": the local gradient copied to the host and the
compression, error feedback and packed momentum there. On a CPU-only machine both run the same
operations, so the trajectories must equal the run without offload."""

from __future__ import annotations

import pytest
import torch

from compcomm.testing import run_ranks
from compcomm.zero import validate_zero_config
from compcomm.zero.offload import check_placement

import _zero_offload_cases as zc


@pytest.mark.parametrize("world,stage", [(2, 2), (3, 2), (3, 3), (1, 2)])
def test_onebit_placements_agree(world, stage):
    for r, res in enumerate(run_ranks(world, zc.onebit_placements, stage, timeout=300)):
        assert res["moved"] > 1e-3, res
        for name in ("none", "device", "host"):
            assert res[name]["phase"] == "replicated", (r, res)
        assert res["host"]["where"] == "cpu", res
        if world > 1:  # the momentum is kept 1-bit (packed) after the compressed steps
            assert res["device"]["packed"] >= 1 and res["host"]["packed"] >= 1, res
        # the same operations on the same CPU: equal bit for bit
        assert res["device_err"] == 0.0 and res["host_err"] == 0.0, (r, res)


def test_onebit_placement_config():
    off = {"offload_optimizer": {"device": "cpu"}}
    assert validate_zero_config(dict(off, stage=2))["onebit_placement"] is None
    assert validate_zero_config(dict(off, stage=2, onebit_placement="host"))[
        "onebit_placement"] == "host"
    with pytest.raises(ValueError, match="onebit_placement must be"):
        validate_zero_config(dict(off, stage=2, onebit_placement="gpu"))
    with pytest.raises(ValueError, match="onebit_placement='host' needs offload_optimizer"):
        validate_zero_config({"stage": 2, "onebit_placement": "host"})


class _Comm:
    def __init__(self, name: str, size: int) -> None:
        self.name, self.n = name, size

    def size(self) -> int:
        return self.n

    def backend_name(self) -> str:
        return self.name


def test_onebit_placement_host_needs_host_buffers():
    cfg = {"onebit_placement": "host"}
    cuda = torch.device("cuda", 0)
    with pytest.raises(ValueError, match="onebit_placement='host' needs a communicator"):
        check_placement(cfg, _Comm("nccl", 2), cuda)
    with pytest.raises(ValueError, match="torch:nccl"):
        check_placement(cfg, _Comm("torch:nccl", 4), cuda)
    for comm, dev in ((_Comm("mpi", 2), cuda), (_Comm("nccl", 1), cuda),
                      (_Comm("torch:gloo", 3), torch.device("cpu"))):
        check_placement(cfg, comm, dev)
    check_placement({"onebit_placement": "device"}, _Comm("nccl", 2), cuda)
