"""compcomm.quantize (blockwise int8, absmax per block, fp32 scales) against a numpy reference,
bit for bit: payload bytes and dequantized values, fp32/bf16/fp16, counts that do not fill a
block; CUDA against CPU where a GPU is present."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compcomm.quantize import (dequantize_blockwise, payload_bytes, quantize_blockwise,
                               round_stochastic)

COUNTS = [0, 1, 7, 255, 256, 257, 1000, 4099]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ref_quantize(x: np.ndarray, block: int, u: "np.ndarray | None" = None) -> bytes:
    n = x.size
    nb = -(-n // block)
    xb = np.zeros(nb * block, np.float32)
    xb[:n] = x
    xb = xb.reshape(nb, block)
    scales = (np.abs(xb).max(axis=1) if nb else np.zeros(0, np.float32)) / np.float32(127)
    scales = scales.astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1)).astype(np.float32)
    y = (xb / safe[:, None]).astype(np.float32)
    r = np.rint(y) if u is None else np.floor((y + u.reshape(nb, block)).astype(np.float32))
    q = np.clip(r, -127, 127).astype(np.int8)
    return scales.tobytes() + q.tobytes()


def _ref_dequantize(payload: bytes, n: int, block: int) -> np.ndarray:
    nb = -(-n // block)
    scales = np.frombuffer(payload[:4 * nb], np.float32)
    q = np.frombuffer(payload[4 * nb:], np.int8).reshape(nb, block).astype(np.float32)
    return (q * scales[:, None]).reshape(-1)[:n]


def _data(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 2, max(n, 1))[:n]
    if n > 300:
        x[256:512] = 0.0  # an all-zero block: scale 0, values 0
        x[5] = -x[:256].abs().max() * 2  # a negative absmax
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", COUNTS)
@pytest.mark.parametrize("block", [128, 256])
def test_quantize_matches_numpy_bitwise(n, dtype, block):
    x = _data(n, dtype)
    got = quantize_blockwise(x, block)
    assert got.dtype == torch.uint8 and got.numel() == payload_bytes(n, block)
    ref = _ref_quantize(x.float().numpy(), block)
    assert got.numpy().tobytes() == ref
    out = torch.empty(n, dtype=dtype)
    dequantize_blockwise(got, n, out, block)
    want = torch.from_numpy(_ref_dequantize(ref, n, block).copy()).to(dtype)
    assert torch.equal(out.view(-1), want)
    if n:  # the error bound: half a step of the block's absmax / 127 (plus the output rounding)
        err = (out.float() - x.float()).abs().max()
        assert err <= x.float().abs().max() / 254 * 1.01 + x.float().abs().max() * 2 ** -7


@pytest.mark.parametrize("segments", [[0, 5, 0, 300, 1], [256, 256, 3], [1000]])
def test_segments_start_blocks(segments):
    """Each segment quantized on its own, payloads' scales then values concatenated."""
    n = sum(segments)
    x = _data(n, torch.bfloat16)
    got = quantize_blockwise(x, 128, segments=segments)
    assert got.numel() == payload_bytes(n, 128, segments)
    parts, off = [], 0
    for s in segments:
        parts.append(_ref_quantize(x[off:off + s].float().numpy(), 128))
        off += s
    nbs = [-(-s // 128) for s in segments]
    ref = b"".join(p[:4 * k] for p, k in zip(parts, nbs)) + b"".join(p[4 * k:] for p, k in
                                                                      zip(parts, nbs))
    assert got.numpy().tobytes() == ref
    out = torch.empty(2 * n, dtype=torch.bfloat16)
    dequantize_blockwise(torch.cat([got, got]), n, out, 128, segments)
    want = np.concatenate([_ref_dequantize(p, s, 128) for p, s in zip(parts, segments)])
    assert torch.equal(out[:n], torch.from_numpy(want).to(torch.bfloat16))
    assert torch.equal(out[n:], out[:n])
    with pytest.raises(ValueError, match="'segments'"):
        quantize_blockwise(x, 128, segments=[n + 1])


def test_dequantize_rows_like_an_allgather():
    """R payloads end to end (what an all-gather delivers) land in R rows of the output."""
    n, rows = 301, 3
    xs = [_data(n, torch.float32, seed=r) for r in range(rows)]
    payload = torch.cat([quantize_blockwise(x, 128) for x in xs])
    out = torch.empty(rows * n)
    dequantize_blockwise(payload, n, out, 128)
    for r, x in enumerate(xs):
        single = torch.empty(n)
        dequantize_blockwise(quantize_blockwise(x, 128), n, single, 128)
        assert torch.equal(out[r * n:(r + 1) * n], single)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 257, 4099])
def test_stochastic_rounding_matches_numpy_bitwise(n, dtype):
    """floor(x / scale + u) with u the generator's uniform draws, one per padded element."""
    x = _data(n, dtype)
    got = quantize_blockwise(x, 128, generator=torch.Generator().manual_seed(7))
    nb = -(-n // 128)
    u = torch.rand((nb, 128), generator=torch.Generator().manual_seed(7)).numpy()
    assert got.numpy().tobytes() == _ref_quantize(x.float().numpy(), 128, u)
    again = quantize_blockwise(x, 128, generator=torch.Generator().manual_seed(7))
    assert torch.equal(got, again)


def test_stochastic_rounding_is_unbiased():
    """The mean of many stochastic roundings approaches x, below half a step too, where rounding
    to nearest stays put; each value is one of the two neighbouring steps."""
    x = torch.tensor([1.0, 0.3 / 127, -0.1 / 127, 0.5 / 127] * 32)  # absmax 1: step 1/127
    g = torch.Generator().manual_seed(0)
    outs = []
    for _ in range(2000):
        out = torch.empty(128)
        dequantize_blockwise(quantize_blockwise(x, 128, generator=g), 128, out, 128)
        outs.append(out)
    outs_t = torch.stack(outs)
    assert float((outs_t - x).abs().max()) <= 1 / 127 * 1.0001
    assert float((outs_t.mean(0) - x).abs().max()) < 0.05 / 127  # ~4 sigma of the mean
    nearest = torch.empty(128)
    dequantize_blockwise(quantize_blockwise(x, 128), 128, nearest, 128)
    assert float(nearest[1]) == 0.0 and float(nearest[2]) == 0.0


def test_round_stochastic_bf16_matches_numpy_and_is_unbiased():
    """Add a uniform 16-bit integer to the float32 pattern, clear the low half: bit for bit
    against numpy on the generator's draws; both signs; the mean approaches x."""
    x = _data(4099, torch.float32)
    got = round_stochastic(x, torch.bfloat16, torch.Generator().manual_seed(5))
    r = torch.randint(0, 1 << 16, x.shape, generator=torch.Generator().manual_seed(5),
                      dtype=torch.int32).numpy()
    bits = (x.numpy().view(np.int32) + r) & np.int32(-65536)
    assert got.dtype == torch.bfloat16
    assert np.array_equal(got.float().numpy(), bits.view(np.float32))
    assert torch.equal(round_stochastic(x, torch.bfloat16), x.to(torch.bfloat16))
    assert torch.equal(round_stochastic(x, torch.float16, torch.Generator()), x.to(torch.float16))
    y = torch.tensor([1 + 2 ** -9, -(1 + 2 ** -9), 3e-5 * (1 + 2 ** -5)] * 4000)
    g = torch.Generator().manual_seed(0)
    mean = torch.stack([round_stochastic(y, torch.bfloat16, g).float() for _ in range(10)]).mean(0)
    for k in range(3):
        rel = float((mean.view(-1, 3)[:, k].mean() - y[k]) / y[k])
        assert abs(rel) < 2e-4, (k, rel)  # nearest is off by 2**-9 = 2e-3 for the first two
    with pytest.raises(TypeError, match="'x'"):
        round_stochastic(x.double(), torch.bfloat16)


def test_argument_errors():
    with pytest.raises(ValueError, match="'block'"):
        quantize_blockwise(torch.zeros(4), 6)
    with pytest.raises(TypeError, match="'x'"):
        quantize_blockwise(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="'out'"):
        quantize_blockwise(torch.zeros(4), 128, out=torch.empty(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="'payload'"):
        dequantize_blockwise(torch.zeros(10, dtype=torch.uint8), 4, torch.empty(4), 128)
    with pytest.raises(ValueError, match="'n'"):
        payload_bytes(-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_equals_cpu(dtype):
    x = _data(4099, dtype)
    cpu = quantize_blockwise(x)
    gpu = quantize_blockwise(x.cuda())
    assert torch.equal(gpu.cpu(), cpu)
    out = torch.empty(4099, dtype=dtype, device="cuda")
    dequantize_blockwise(gpu, 4099, out)
    ref = torch.empty(4099, dtype=dtype)
    dequantize_blockwise(cpu, 4099, ref)
    assert torch.equal(out.cpu(), ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_stochastic_rounding_matches_numpy():
    """CUDA draws its own numbers: the same formula on them, bit for bit."""
    x = _data(4099, torch.bfloat16)
    got = quantize_blockwise(x.cuda(), 128,
                             generator=torch.Generator(device="cuda").manual_seed(3))
    u = torch.rand((33, 128), generator=torch.Generator(device="cuda").manual_seed(3),
                   device="cuda").cpu().numpy()
    assert got.cpu().numpy().tobytes() == _ref_quantize(x.float().numpy(), 128, u)
