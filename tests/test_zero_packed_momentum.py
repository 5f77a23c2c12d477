"""The packed 1-bit momentum of ZeRO + OneBitAdam (issue 19): pack/unpack against a numpy
reference on both paths (C++ kernels, torch ops), sizes that are not multiples of 8 or of the
chunk, fp32/fp16/bf16 inputs, bad inputs; OneBitCompressor.packed_average's handed-back signs and
scales against the averaged values (W = 1..4, uneven sizes); ZeRO's exact and no_allgather modes
keeping the momentum packed, still on unsharded OneBitAdam's trajectory; exact resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compcomm.testing import run_ranks
from compcomm.zero.packed_momentum import PackedMomentum, pack, pack_torch, unpack, unpack_torch

import _zero_packed_cases as pc

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _ref_pack(x: np.ndarray, chunk: int):
    bits = ~(x < 0)
    signs = np.packbits(bits.astype(np.uint8))  # MSB first, as the kernels
    scales = np.abs(x).reshape(-1, chunk).max(axis=1).astype(np.float32)
    return signs, scales


def _ref_unpack(signs: np.ndarray, scales: np.ndarray, chunk: int, numel: int, begin: int,
                count: int) -> np.ndarray:
    k = np.arange(begin, begin + count)
    bits = np.unpackbits(signs)
    out = np.zeros(count, dtype=np.float32)
    live = k < numel
    kl = k[live]
    out[live] = np.where(bits[kl] == 1, scales[kl // chunk], -scales[kl // chunk])
    return out


def _one_bit(padded: int, world: int, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    chunk = padded // world
    tau = torch.rand(world, generator=g) + 0.1
    s = torch.randint(0, 2, (padded,), generator=g).float() * 2 - 1
    x = tau.repeat_interleave(chunk) * s
    x[numel:] = 0
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["dispatch", "torch"])
@pytest.mark.parametrize("padded,world,numel", [(8, 1, 8), (8, 1, 3), (96, 3, 85), (96, 4, 96),
                                                (4096, 4, 4093), (720, 3, 1), (160, 4, 0),
                                                (98304, 3, 70001)])  # long runs: the table path
def test_unpack_matches_numpy(device, path, padded, world, numel):
    chunk = padded // world
    x = _one_bit(padded, world, numel, padded + numel)
    signs, scales = _ref_pack(x.numpy(), chunk)
    fn = unpack if path == "dispatch" else unpack_torch
    ts, tt = torch.from_numpy(signs).to(device), torch.from_numpy(scales).to(device)
    for begin, count in [(0, padded), (chunk * (world - 1), chunk), (5, min(13, padded - 5)),
                         (padded, 0), (3, padded - 3)]:
        out = torch.full((count,), 7.0, device=device)
        fn(ts, tt, chunk, numel, begin, out)
        np.testing.assert_array_equal(out.cpu().numpy(),
                                      _ref_unpack(signs, scales, chunk, numel, begin, count))
    # mul folds in `out.mul_(mul)` (1-bit Adam's b1 * m), on both paths the same bits
    for mul in (0.9, 0.999, -0.5):
        ref = fn(ts, tt, chunk, numel, 0, torch.empty(padded, device=device)).mul_(mul)
        ref[numel:] = 0
        got = fn(ts, tt, chunk, numel, 0, torch.empty(padded, device=device), mul=mul)
        assert torch.equal(got, ref), mul
    # exact: the 1-bit tensor comes back bit for bit
    np.testing.assert_array_equal(fn(ts, tt, chunk, numel, 0, torch.empty(padded, device=device))
                                  .cpu().numpy(), x.numpy())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("padded,chunk", [(8, 8), (24, 8), (96, 32), (4104, 1368), (0, 1)])
def test_pack_matches_numpy(device, dtype, padded, chunk):
    g = torch.Generator().manual_seed(padded)
    x = torch.randn(padded, generator=g).to(dtype)
    if padded:
        x[0] = -0.0  # reads as +1
    ref_s, ref_t = _ref_pack(x.float().numpy(), chunk) if padded else (np.zeros(0, np.uint8),
                                                                       np.zeros(0, np.float32))
    for fn in (pack, pack_torch):
        s, t = fn(x.to(device), chunk)
        np.testing.assert_array_equal(s.cpu().numpy(), ref_s)
        np.testing.assert_array_equal(t.cpu().numpy(), ref_t)
        assert s.dtype == torch.uint8 and t.dtype == torch.float32


def test_bad_inputs_raise_typed_errors():
    s, t, out = torch.zeros(2, dtype=torch.uint8), torch.ones(2), torch.empty(16)
    with pytest.raises(TypeError, match="signs"):
        unpack(s.float(), t, 8, 16, 0, out)
    with pytest.raises(TypeError, match="scales"):
        unpack(s, t.double(), 8, 16, 0, out)
    with pytest.raises(TypeError, match="out"):
        unpack(s, t, 8, 16, 0, out.half())
    with pytest.raises(ValueError, match="chunk"):
        unpack(s, t, 0, 16, 0, out)
    with pytest.raises(ValueError, match="do not cover"):
        unpack(s, t, 8, 24, 0, torch.empty(24))
    with pytest.raises(ValueError, match="begin"):
        unpack(s, t, 8, 16, -1, out)
    with pytest.raises(TypeError, match="x must be"):
        pack(torch.zeros(8, dtype=torch.float64), 8)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack(torch.zeros(12), 4)
    with pytest.raises(ValueError, match="chunk"):
        pack(torch.zeros(16), 5)
    # the binding checks too (its own entry point), naming the argument
    from compcomm import _C
    from compcomm._buffers import buffer_of

    with pytest.raises(ValueError, match="signs"):
        _C.kernels.unpack_momentum(buffer_of(s), buffer_of(t), 8, 24, 0, buffer_of(torch.empty(24)))
    with pytest.raises(ValueError, match="scales"):
        _C.kernels.pack_momentum(buffer_of(torch.zeros(16)), 8, buffer_of(s),
                                 buffer_of(torch.ones(3)))


def test_packed_momentum_store_and_state_dict():
    pm = PackedMomentum()
    x = _one_bit(96, 3, 85, 1)
    s, t = pack(x, 32)
    pm.put(("g", 0), s, t, 85, 32)
    assert ("g", 0) in pm and pm.nbytes() == 12 + 12
    with pytest.raises(TypeError):
        pm.put(("g", 1), s.float(), t, 85, 32)
    with pytest.raises(ValueError, match="do not cover"):
        pm.put(("g", 1), s, t, 200, 32)
    pm2 = PackedMomentum()
    pm2.load_state_dict(pm.state_dict())
    out = torch.empty(96)
    assert torch.equal(pm2.unpack_(("g", 0), out), x)
    pm.reset()
    assert pm.nbytes() == 0 and pm.keys() == []


CASES = [
    {"mode": "exact", "stage": 2, "gas": 1, "steps": 20, "kwargs": mc_kw}
    for mc_kw in [{"lr": 1e-2, "freeze_step": 4, "weight_decay": 0.01}]
] + [
    {"mode": "no_allgather", "stage": 1, "gas": 1, "steps": 20,
     "kwargs": {"lr": 1e-2, "freeze_step": 4, "weight_decay": 0.01}},
    {"mode": "no_allgather", "stage": 2, "gas": 1, "steps": 20, "dtype": "bfloat16",
     "kwargs": {"lr": 1e-2, "freeze_step": 4, "weight_decay": 0.01}},
]
RESUMES = [{"mode": "no_allgather", "stage": 2, "gas": 1, "steps": 10, "save_at": [6],
            "kwargs": {"lr": 1e-2, "freeze_step": 4, "weight_decay": 0.01}}]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return {w: run_ranks(w, pc.rank_body, CASES, RESUMES,
                         str(tmp_path_factory.mktemp(f"packed_w{w}")), timeout=600)
            for w in (1, 2, 3, 4)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_packed_average_hands_back_the_result(results, world):
    for r in range(world):
        got = results[world][r]["avg"]
        if world == 1:
            assert got["packs"] is None  # nothing compressed with one rank
            continue
        assert got["exact"] and all(got["exact"]) and all(got["repack"])
        for (s, t), (s0, t0) in zip(got["packs"], results[world][0]["avg"]["packs"]):
            np.testing.assert_array_equal(s, s0)  # the same bits on every rank
            np.testing.assert_array_equal(t, t0)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("ci", range(len(CASES)))
def test_zero_keeps_momentum_packed_on_unsharded_trajectory(results, world, ci):
    bf16 = CASES[ci].get("dtype") == "bfloat16"
    for r in range(world):
        got = results[world][r]["cases"][ci]
        for t, (a, e) in enumerate(zip(got["zero"], got["plain"]), start=1):
            np.testing.assert_allclose(a, e, rtol=1e-2 if bf16 else 1e-6,
                                       atol=2e-3 if bf16 else 1e-6, err_msg=f"W={world} r{r} t{t}")
        if world == 1:  # nothing compressed: the momentum stays fp32
            assert got["fp32_momentum_groups"] == 1 and got["packed_keys"] == []
            continue
        assert got["fp32_momentum_groups"] == 0  # no fp32 momentum left after the first step
        assert got["packed_keys"] == [(0, b) for b in range(got["buckets"])]
        assert got["packed_bytes"] == got["flat"] // 8 + 4 * world * got["buckets"]
        assert got["shards_match"]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_resume_from_packed_momentum_is_exact(results, world):
    """A checkpoint taken while the momentum is packed (its shards hold the unpacked values)
    resumes bit for bit: the next step regathers the fp32 momentum, which packs again."""
    for r in range(world):
        res = results[world][r]["resume"][0]
        for s, traj in res["resumed"].items():
            for t, a in traj.items():
                np.testing.assert_array_equal(a, res["full"][t], err_msg=f"W={world} r{r} from {s}")


@pytest.mark.parametrize("bc,wd,dtype", [(False, 0.0, None), (True, 0.01, None),
                                         (False, 0.01, torch.bfloat16)])
def test_cpu_update_with_frozen_denominator(bc, wd, dtype):
    """no_allgather's CPU update: onebit_compressed_step_ reading the frozen denominator (computed
    once by functional.adam_denom) gives the bits of recomputing it from v every step, and of the
    torch ops."""
    from compcomm.optim import cpu_adam
    from compcomm.optim import functional as F

    g = torch.Generator().manual_seed(5)
    n = 4099
    group = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": wd,
             "bias_correction": bc}
    w, y = torch.randn(n, generator=g), torch.randn(n, generator=g)
    v = torch.rand(n, generator=g)
    d = F.adam_denom(v, group, 4)
    ref_w, ref_m = w.clone(), y.clone()
    out_ref = torch.empty(n, dtype=dtype) if dtype else None
    cpu_adam.onebit_compressed_step_(ref_w, ref_m, v, ref_m, group, 9, 4, param_out=out_ref)
    got_w, got_m = w.clone(), y.clone()
    out = torch.empty(n, dtype=dtype) if dtype else None
    cpu_adam.onebit_compressed_step_(got_w, got_m, d, got_m, group, 9, 4, param_out=out,
                                     denom=True)
    if cpu_adam.matches_torch_rules(denom=True):  # the torch ops' bits, given d
        tw = w.clone()
        tw.add_(F.adam_update(y, d, tw, group, 9, 4, denom=d), alpha=-group["lr"])
        assert torch.equal(tw, got_w)
    if not cpu_adam.matches_torch_rules():
        # This CPU's torch sqrt differs from the kernels' by an ulp (seen on an AMD EPYC VM), so
        # adam_denom's bits are not the kernel's own square root's: the kernel reading v is only
        # close to the one reading d (the optimizers then take d: cpu_kernels_usable(frozen=True))
        torch.testing.assert_close(got_w, ref_w, rtol=1e-6, atol=1e-7)
        assert torch.equal(got_m, ref_m)
        return
    assert torch.equal(got_w, ref_w) and torch.equal(got_m, ref_m)
    if dtype:
        assert torch.equal(out, out_ref)
