"""ZeRO-Offload: trajectories with and without offload at W=1,2,3 (stages 1-3, fp32/bf16), config
acceptance and rejections, estimate_memory vs memory_bytes, checkpoints across offload settings,
the non-finite skip. On a CPU-only machine the offload goes through the same host buffers,
bucket-by-bucket copies and CPU step (no pinning, no streams)."""

from __future__ import annotations

import pytest
import torch

from compcomm.testing import run_ranks
from compcomm.zero import ZeroOptimizer, estimate_memory, validate_zero_config
from compcomm.zero.memory import model_numels

import _zero_bodies as zb
import _zero_offload_cases as zc

_ALL = [{"stage": s, "dtype": d} for s in (1, 2, 3) for d in ("float32", "bfloat16")]
_EXTRA = [  # W=3 only: accumulation + clipping + overlap, offload_param, the non-kernel path,
    # Adam (L2), the non-finite skip, OneBitAdam (exact) through warm-up and compressed phase
    {"stage": 2, "gas": 2, "clip": 0.05, "zero": dict(zc.BUCKETS, overlap_comm=True)},
    {"stage": 1, "gas": 2, "clip": 0.05},
    {"stage": 3, "gas": 2, "offload": zc.OFF_PARAM,
     "zero": dict(zc.BUCKETS, stage3_param_persistence_threshold=30)},
    {"stage": 3, "dtype": "bfloat16", "offload": zc.OFF_PARAM},
    {"stage": 3, "offload": {"offload_param": {"device": "cpu"}}},  # parameters only
    {"stage": 2, "opt": "SGD", "opt_kwargs": {"lr": 0.1, "momentum": 0.9}},
    {"stage": 2, "opt": "Adam", "opt_kwargs": {"lr": 1e-2, "weight_decay": 0.1}},
    {"stage": 2, "nan_at": 1},
    {"stage": 2, "opt": "OneBitAdam", "steps": 5,
     "opt_kwargs": {"lr": 1e-2, "freeze_step": 2, "reduce_bucket_size": 100}},
    {"stage": 3, "opt": "OneBitAdam", "steps": 5,
     "opt_kwargs": {"lr": 1e-2, "freeze_step": 2}},
]
# fp32 rounding: the C++ step may differ from torch's CPU AdamW in the last bit on another CPU;
# Adam's normalised update keeps such differences at lr * a few ulps per step
_TOL = {"float32": 1e-6, "bfloat16": 1e-2}


@pytest.fixture(scope="module")
def per_world(tmp_path_factory):
    out = {}
    for world in (1, 2, 3):
        cases = _ALL + (_EXTRA if world == 3 else [])
        d = str(tmp_path_factory.mktemp(f"offload{world}"))
        out[world] = run_ranks(world, zc.rank_body, d, cases, timeout=400)
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_offload_trajectory_matches(per_world, world):
    for r, res in enumerate(per_world[world]):
        for item in res["trajectories"]:
            case = item["case"]
            assert item["moved"] > 1e-3, item
            assert item["err"] <= _TOL[case.get("dtype", "float32")], (r, item)
            if "offload_optimizer" not in case.get("offload", zc.OFF):
                assert item["kernel_steps"] == 0, item  # the step stays where it was
            elif case.get("opt", "AdamW") in ("AdamW", "Adam"):
                assert item["kernel_steps"] >= 1, item  # the C++ CPU Adam ran
            elif case["opt"] == "SGD":
                assert item["kernel_steps"] == 0, item  # the optimizer's own step
            if "nan_at" in case:
                assert item["skipped"] == item["skipped_ref"] == 1, item
            if case.get("opt") == "OneBitAdam":
                assert item["phase"] == "replicated", item  # it reached the compressed phase


@pytest.mark.parametrize("world", [1, 2, 3])
def test_offload_memory_matches_estimate(per_world, world):
    T, _ = model_numels(zb.make_model())
    for r, res in enumerate(per_world[world]):
        for (stage, param), m in res["memory"].items():
            meas, shard = m["measured"], m["shard_numel"]
            est = estimate_memory(zb.make_model(), stage, world,
                                  "optimizer+param" if param else "optimizer", param_bytes=4)
            pad = 4 * (shard * world - T)
            assert meas["device"] + meas["host"] == sum(
                meas[k] for k in ("params", "grads", "master", "optimizer_state"))
            assert meas["master"] == 4 * shard and meas["optimizer_state"] == 8 * shard
            for key in ("params", "grads", "master", "optimizer_state", "device", "host"):
                assert est[key] <= meas[key] <= est[key] + 4 * pad + 8, (stage, param, key, meas,
                                                                       est)
            assert meas["host"] >= 16 * shard  # master, state and the fp32 gradient shard


@pytest.mark.parametrize("world", [1, 2, 3])
def test_offload_checkpoint_round_trip(per_world, world):
    for r, res in enumerate(per_world[world]):
        for (stage, saved_with_offload), err in res["checkpoints"].items():
            assert err <= 1e-6, (r, stage, saved_with_offload, err)


def test_offload_onebit_warmup_sends_nothing_itself():
    """The offloaded OneBitAdam warm-up runs the update rule (step_on) on the host shards, never
    the wrapped optimizer's step() or communicator (ZeRO did the reduce-scatter)."""
    for r, res in enumerate(run_ranks(2, zc.onebit_offload_silent, timeout=300)):
        assert res["moved"] > 1e-3 and res["err"] <= 1e-6, (r, res)


# ---------------------------------------------------------------------------- single process


def test_offload_config_accepted():
    cfg = validate_zero_config({"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True,
                                                                 "buffer_count": 4, "fast_init": False},
                                "offload_param": {"device": "cpu", "max_in_cpu": 10**9}})
    assert cfg["offload_optimizer"]["pin_memory"] is True
    assert cfg["offload_optimizer"]["ratio"] == 1.0  # DeepSpeed's defaults filled in
    assert cfg["offload_param"]["pin_memory"] is False
    for stage in (1, 2):
        assert validate_zero_config({"stage": stage, "offload_optimizer": {"device": "cpu"}})[
            "offload_optimizer"]["device"] == "cpu"
    off = validate_zero_config({"stage": 2, "offload_optimizer": {"device": "none"}})
    assert off["offload_optimizer"] is None and off["offload_param"] is None


@pytest.mark.parametrize("cfg,key", [
    ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}},
     r"offload_optimizer\.device='nvme'"),
    ({"stage": 3, "offload_param": {"device": "nvme"}}, r"offload_param\.device='nvme'"),
    ({"stage": 2, "offload_optimizer": {"device": "gpu"}}, r"offload_optimizer\.device"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, r"offload_optimizer\.ratio"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "pin": True}}, r"offload_optimizer\.pin"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": "yes"}},
     r"offload_optimizer\.pin_memory"),
    ({"stage": 2, "offload_param": {"device": "cpu"}}, r"offload_param: parameter offload needs stage 3"),
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, r"offload_optimizer: offload needs"),
    ({"stage": 2, "offload_optimizer": "cpu"}, r"offload_optimizer must be an object"),
])
def test_offload_config_rejected(cfg, key):
    with pytest.raises(ValueError, match=key):
        validate_zero_config(cfg)


@pytest.mark.parametrize("stage,opt,mode,key", [
    (2, "OneBitAdam", "sharded", "OneBitAdam with onebit_mode='sharded'"),
    (2, "OneBitAdam", "no_allgather", "OneBitAdam with onebit_mode='no_allgather'"),
    (2, "ZeroOneAdam", None, "ZeroOneAdam"),
])
def test_offload_rejects_other_onebit_modes(stage, opt, mode, key):
    import compcomm.optim as co

    model = zb.make_model()
    zero = dict(zc.OFF, onebit_mode=mode) if mode else zc.OFF
    with pytest.raises(ValueError, match=key):
        ZeroOptimizer(model.parameters(), getattr(co, opt), stage=stage, module=model,
                      optimizer_kwargs={"lr": 1e-3}, **zero)


def test_estimate_memory_offload_split():
    T, G = 10**9, 8
    for stage in (1, 2, 3):
        e, o = estimate_memory(T, stage, G), estimate_memory(T, stage, G, "optimizer")
        assert e["host"] == 0 and e["device"] == e["total"] - e["buffers"]
        assert o["host"] == int(16 * T / G)  # master + Adam state + fp32 gradient shard
        assert o["device"] == o["params"] + (2 * T if stage == 1 else 0)
    p = estimate_memory(T, 3, G, "optimizer+param")
    assert p["device"] == 0 and p["host"] == int(18 * T / G)
    with pytest.raises(ValueError, match="offload"):
        estimate_memory(T, 2, G, "optimizer", onebit="ZeroOneAdam")


def test_offload_initialize_from_config():
    """compcomm.zero.initialize with DeepSpeed's offload section trains; the step runs in C++."""
    from compcomm.zero import initialize

    model = zb.make_model()
    z = initialize(model, {"type": "AdamW", "params": {"lr": 1e-2}},
                   {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}})
    before = [p.detach().clone() for p in model.parameters()]
    zc._train(z, model, 0, [0, 1])
    assert z.offload is not None and z.offload.kernel_steps == 2
    assert zc._diff([p.detach() for p in model.parameters()], before) > 1e-3
    z.close()


def test_offload_from_deepspeed_config():
    """compcomm.from_config with a DeepSpeed config that offloads (bf16, stage 3, both dicts)."""
    import compcomm

    cfg = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                 "offload_param": {"device": "cpu", "pin_memory": True}}}
    s = compcomm.from_config(zb.make_model(), cfg)
    z = s.optimizer
    assert z.offload is not None and z.offload.optimizer and z.offload.param
    x, y = zb.batch(0, 0, 0, torch.bfloat16)
    zb.loss_fn(s.model, x, y).backward()
    z.step()
    assert z.offload.kernel_steps == 1 and z.memory_bytes()["host"] > 0
    z.close()


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@_CUDA
@pytest.mark.parametrize("stage,dtype,param", [(1, torch.float32, False), (2, torch.float32, False),
                                               (2, torch.bfloat16, False), (3, torch.float32, False),
                                               (3, torch.bfloat16, True)])
def test_offload_cuda_trajectory(stage, dtype, param):
    """On a GPU (one rank, in-process communicator): pinned host shards, the side-stream gradient
    copies and the piecewise uploads give the no-offload run's parameters to fp32 rounding."""
    got = []
    for off in (None, zc.OFF_PARAM if param else zc.OFF):
        model = zb.make_model(dtype=dtype).cuda()
        z = zc._build(model, stage, dict(zc.BUCKETS, overlap_comm=True, **(off or {})))
        for s in range(4):
            x, y = zb.batch(0, s, 0, dtype)
            zb.loss_fn(model, x.cuda(), y.cuda()).backward()
            z.step()
        if off is not None:
            assert z.offload.pin_optimizer and z.groups[0].master.is_pinned()
            assert z.offload.kernel_steps == 4
        got.append(zc._params(z, model))
        z.close()
    err = zc._diff(*got)
    assert err <= (1e-5 if dtype == torch.float32 else 1e-2), err


@pytest.mark.parametrize("pin_optimizer,pin_param", [(False, True), (True, False)])
def test_offload_pins_each_sections_buffers(pin_optimizer, pin_param):
    """offload_optimizer.pin_memory pins the master, gradient and copy buffers, offload_param's
    its parameter shards; one section's setting does not pin the other's."""
    if not torch.cuda.is_available():
        pytest.skip("pinned memory needs a CUDA device")
    model = zb.make_model().cuda()
    off = {"offload_optimizer": {"device": "cpu", "pin_memory": pin_optimizer},
           "offload_param": {"device": "cpu", "pin_memory": pin_param}}
    z = zc._build(model, 3, dict(zc.BUCKETS, **off))
    grp = z.groups[0]
    assert grp.master.is_pinned() == grp.master.grad.is_pinned() == pin_optimizer
    assert grp.param_shard.device.type == "cpu" and grp.param_shard.is_pinned() == pin_param
    z.close()
