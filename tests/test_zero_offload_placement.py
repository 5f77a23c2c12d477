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
    with pytest.raises(ValueError, match="'nccl' with 1 ranks"):  # refuses host buffers alone too
        check_placement(cfg, _Comm("nccl", 1), cuda)
    for comm, dev in ((_Comm("mpi", 2), cuda), (_Comm("local", 1), cuda),
                      (_Comm("torch:gloo", 3), cuda), (_Comm("nccl", 2), torch.device("cpu"))):
        check_placement(cfg, comm, dev)
    check_placement({"onebit_placement": "device"}, _Comm("nccl", 2), cuda)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onebit_placements_cuda(dtype):
    """One rank on a GPU: OneBitAdam without offload, with offload ("device") and with
    ``onebit_placement="host"`` (the local gradient goes to the host, the 1-bit buffers live
    there) give the same parameters to fp32 rounding."""
    import _zero_bodies as zb

    got = []
    for zero in ({}, zc.OFF, dict(zc.OFF, onebit_placement="host")):
        model = zb.make_model(dtype=dtype).cuda()
        z = zc._build(model, 2, dict(zc.BUCKETS, **zero), "OneBitAdam",
                      {"lr": 1e-2, "freeze_step": 2})
        for s in range(5):
            x, y = zb.batch(0, s, 0, dtype)
            zb.loss_fn(model, x.cuda(), y.cuda()).backward()
            z.step()
        assert z.phase.value == "replicated"
        got.append(zc._params(z, model))
        z.close()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert zc._diff(got[0], got[1]) <= tol and zc._diff(got[1], got[2]) <= tol
