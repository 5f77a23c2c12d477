"""The CPU kernels (the CUDA kernels' twins) against the numpy oracle, one kernel at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import compcomm
from compcomm import _C
from compcomm._buffers import buffer_of

from reference import pack_signs, sign, worker_scale

K = _C.kernels
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 7, 8, 4099, 2**20 + 3]


def _padded(n: int) -> int:
    return -(-n // 64) * 64


def _x(m: torch.Tensor, e: torch.Tensor) -> np.ndarray:
    x = np.zeros(e.numel(), np.float32)
    x[: m.numel()] = m.float().numpy()
    return (x + e.numpy()).astype(np.float32)


def _inputs(n: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=g).to(dtype)
    m[::31] = 0.0
    m[3::37] = -0.0
    e = torch.randn(_padded(n), generator=g) * 0.1
    return m, e


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_worker_scale_pack(n, dtype):
    m, e = _inputs(n, dtype, n)
    x = _x(m, e)
    scale = torch.full((1,), float("nan"))
    signs = torch.full((e.numel() // 8,), 0xA5, dtype=torch.uint8)
    ws = torch.empty(max(1, K.scale_workspace_bytes(e.numel(), False)), dtype=torch.uint8)
    K.worker_scale_pack(buffer_of(m), buffer_of(e), buffer_of(scale), buffer_of(signs), buffer_of(ws))
    assert scale.item() == pytest.approx(float(worker_scale(x)), rel=1e-6)
    np.testing.assert_array_equal(signs.numpy(), pack_signs(x))


def test_sign_rules():
    # +0, -0 and NaN pack as +1; only v < 0 packs as -1 (ONEBIT_SPEC.md a.2 step 4).
    m = torch.tensor([0.0, -0.0, float("nan"), -1e-30, 1e-30, -float("inf"), float("inf"), -2.0])
    e = torch.zeros(8)
    signs = torch.zeros(1, dtype=torch.uint8)
    scale, ws = torch.zeros(1), torch.zeros(1, dtype=torch.uint8)  # Buffers do not keep tensors alive
    K.worker_scale_pack(buffer_of(m), buffer_of(e), buffer_of(scale), buffer_of(signs), buffer_of(ws))
    assert signs.item() == 0b11101010


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_server_kernels(world):
    rng = np.random.default_rng(world)
    chunk = 8 * 513
    signs = torch.from_numpy(rng.integers(0, 256, world * chunk // 8, dtype=np.uint8))
    # Scales live at a stride inside records, as in the algorithm's headers.
    stride = 8
    scales = torch.zeros(world * stride)
    scales[::stride] = torch.from_numpy(rng.uniform(0.1, 2.0, world).astype(np.float32))
    serr = torch.from_numpy(rng.normal(0, 0.1, chunk).astype(np.float32))

    bits = np.unpackbits(signs.numpy(), bitorder="big").reshape(world, chunk)
    a = [np.float32(scales[i * stride].item()) * (np.float32(1) / np.float32(world)) for i in range(world)]
    c = sum(np.where(bits[i] == 1, 1.0, -1.0) * np.float64(np.float32(a[i])) for i in range(world))
    c = c + serr.numpy().astype(np.float64)
    tau_ref = np.sqrt(np.sum(c**2)) / np.sqrt(chunk)

    tau = torch.zeros(1)
    packed = torch.zeros(chunk // 8, dtype=torch.uint8)
    ws = torch.empty(max(1, K.scale_workspace_bytes(chunk, False)), dtype=torch.uint8)
    K.server_scale_pack(buffer_of(signs), buffer_of(scales), stride, world, buffer_of(serr), buffer_of(tau),
                        buffer_of(packed), buffer_of(ws))
    assert tau.item() == pytest.approx(tau_ref, rel=1e-6)
    near_zero = np.abs(c) <= 1e-5 * np.abs(c).max()
    got = np.unpackbits(packed.numpy(), bitorder="big")
    want = (c >= 0).astype(np.uint8)
    assert np.all((got == want) | near_zero)

    before = serr.clone()
    K.server_update(buffer_of(signs), buffer_of(scales), stride, world, buffer_of(serr), buffer_of(tau))
    want_err = c - np.float64(tau.item()) * sign(c)
    ok = ~near_zero
    np.testing.assert_allclose(serr.numpy()[ok], want_err[ok], atol=1e-6 * np.abs(c).max())
    assert not torch.equal(before, serr)


@pytest.mark.parametrize("world,blocks", [(1, 1), (2, 3), (3, 513), (4, 4099), (7, 64), (300, 5)])
def test_server_kernels_bit_exact(world, blocks):
    """The server passes equal, bit for bit, the fp32 sum of ONEBIT_SPEC.md a.2 step 3 in its
    order: +0, then +-scale_i * fl32(1/W) rank by rank, then the server error; the new server error
    is c - tau * sign(c). Block counts that leave 1-3 blocks past the kernels' 4-block groups; 300
    ranks take the path without cached weights."""
    rng = np.random.default_rng(world * 1000 + blocks)
    chunk = 8 * blocks
    signs = torch.from_numpy(rng.integers(0, 256, world * chunk // 8, dtype=np.uint8))
    stride = 3
    scales = torch.zeros(world * stride)
    scales[::stride] = torch.from_numpy(rng.uniform(0.1, 2.0, world).astype(np.float32))
    serr = torch.from_numpy(rng.normal(0, 0.1, chunk).astype(np.float32))
    bits = np.unpackbits(signs.numpy(), bitorder="big").reshape(world, chunk)
    inv_w = np.float32(1) / np.float32(world)
    c = np.zeros(chunk, np.float32)
    for i in range(world):
        a = np.float32(scales[i * stride].item()) * inv_w
        c = c + np.where(bits[i] == 1, a, -a).astype(np.float32)
    c = c + serr.numpy()
    tau, packed = torch.zeros(1), torch.zeros(chunk // 8, dtype=torch.uint8)
    ws = torch.zeros(1, dtype=torch.uint8)
    K.server_scale_pack(buffer_of(signs), buffer_of(scales), stride, world, buffer_of(serr), buffer_of(tau),
                        buffer_of(packed), buffer_of(ws))
    np.testing.assert_array_equal(packed.numpy(), np.packbits(~(c < 0), bitorder="big"))
    K.server_update(buffer_of(signs), buffer_of(scales), stride, world, buffer_of(serr), buffer_of(tau))
    t = np.float32(tau.item())
    np.testing.assert_array_equal(serr.numpy().view(np.uint32), (c - np.where(c < 0, -t, t)).view(np.uint32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world", [1, 3, 4])
def test_worker_update_decompress(dtype, world):
    n = 1000
    padded = -(-n // (8 * world)) * 8 * world
    chunk = padded // world
    m, _ = _inputs(n, dtype, 5)
    e = torch.randn(padded) * 0.1
    x = _x(m, e)
    sigma = torch.tensor([0.75])
    record = 16 + -(-(chunk // 8) // 16) * 16
    records = torch.zeros(world * record, dtype=torch.uint8)
    rng = np.random.default_rng(0)
    taus = rng.uniform(0.5, 1.5, world).astype(np.float32)
    out_signs = rng.integers(0, 256, (world, chunk // 8), dtype=np.uint8)
    for j in range(world):
        records[j * record : j * record + 4] = torch.from_numpy(taus[j : j + 1].view(np.uint8))
        records[j * record + 16 : j * record + 16 + chunk // 8] = torch.from_numpy(out_signs[j])
    K.worker_update_decompress(
        buffer_of(m), buffer_of(e), buffer_of(sigma), buffer_of(records.view(torch.float32)), record // 4,
        _C.Buffer(records.data_ptr() + 16, records.numel() - 16, _C.DType.uint8, -1), record, world,
    )
    np.testing.assert_allclose(e.numpy(), x - 0.75 * sign(x), rtol=0, atol=1e-7)
    bits = np.unpackbits(out_signs, bitorder="big", axis=1)
    want = np.concatenate([taus[j] * np.where(bits[j] == 1, 1.0, -1.0) for j in range(world)])[:n]
    want = torch.from_numpy(want.astype(np.float32)).to(dtype)  # tau rounded to the output dtype
    assert torch.equal(m, want)


@pytest.mark.parametrize("count", [0, 1, 7, 8, 4099])
def test_decompress(count):
    """One chunk of a compressed reduce-scatter's result: scale * (+1 / -1) from MSB-first bits."""
    rng = np.random.default_rng(count)
    packed = rng.integers(0, 256, max(1, -(-count // 8)), dtype=np.uint8)
    out = torch.full((count,), 7.0)
    scale, packed_t = torch.tensor([0.5]), torch.from_numpy(packed)  # alive: a Buffer does not own them
    K.decompress(buffer_of(scale), buffer_of(packed_t), buffer_of(out))
    bits = np.unpackbits(packed, bitorder="big")[:count]
    np.testing.assert_array_equal(out.numpy(), np.where(bits == 1, 0.5, -0.5).astype(np.float32))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 10**7), world=st.integers(1, 64))
def test_padded_numel(n, world):
    p = compcomm.padded_numel(n, world)
    assert p >= n and p % (8 * world) == 0
    unit = world * np.lcm(world, 8)
    assert p % unit == 0 and p - n < unit


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=64))
def test_pack_matches_numpy_on_any_floats(values):
    m = torch.tensor(values, dtype=torch.float32)
    e = torch.zeros(_padded(len(values)))
    signs = torch.zeros(e.numel() // 8, dtype=torch.uint8)
    scale, ws = torch.zeros(1), torch.zeros(1, dtype=torch.uint8)
    K.worker_scale_pack(buffer_of(m), buffer_of(e), buffer_of(scale), buffer_of(signs), buffer_of(ws))
    np.testing.assert_array_equal(signs.numpy(), pack_signs(_x(m, e)))


def test_generic_and_avx2_paths_agree(tmp_path):
    """The generic kernels (forced with COMPCOMM_DISABLE_AVX2=1) give the same bits and values."""
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(
        "import sys, torch, compcomm\n"
        "torch.manual_seed(0)\n"
        "out = {}\n"
        "for dt in (torch.float32, torch.float16, torch.bfloat16):\n"
        "    for n in (1, 7, 4099, 100003):\n"
        "        m = (torch.randn(n) * 3).to(dt); we, se = compcomm.error_buffers(n)\n"
        "        we += torch.randn(we.numel()) * 0.1\n"
        "        for _ in range(2):\n"
        "            compcomm.compressed_allreduce(m, we, se)\n"
        "        out[(str(dt), n)] = (m.float(), we, se)\n"
        "torch.save(out, sys.argv[1])\n"
    )
    runs = []
    for env_extra in ({}, {"COMPCOMM_DISABLE_AVX2": "1"}):
        path = tmp_path / f"out{len(runs)}.pt"
        env = {k: v for k, v in __import__("os").environ.items() if k != "COMPCOMM_DISABLE_AVX2"}
        env.update(env_extra)
        subprocess.run([sys.executable, str(script), str(path)], check=True, env=env, timeout=300)
        runs.append(torch.load(path))
    for key, (m0, we0, se0) in runs[0].items():
        m1, we1, se1 = runs[1][key]
        # Outputs are +-tau: equal up to the fp64-sum rounding of the scales.
        torch.testing.assert_close(m0, m1, rtol=1e-6, atol=0)
        torch.testing.assert_close(we0, we1, rtol=1e-6, atol=1e-6 * float(we0.abs().max()))
        torch.testing.assert_close(se0, se1, rtol=1e-6, atol=1e-6 * float(se0.abs().max()))
        assert torch.equal(torch.sign(m0), torch.sign(m1)), key
