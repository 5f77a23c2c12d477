"""Blockwise int8 quantization (absmax per block, fp32 scales) as one byte payload.

Used by :mod:`compcomm.fsdp_gather` to all-gather FSDP2's parameter shards in about half the bytes
of bf16 (a quarter of fp32). The payload of ``n`` elements with block size ``B`` is
``nb = ceil(n / B)`` blocks laid out as ``[nb fp32 scales][nb * B int8 values]`` (``nb * (4 + B)``
bytes), so a gathered ``(W, payload)`` buffer is W payloads end to end and each row is dequantized
the same way on every rank. With ``segments`` (sizes summing to ``n``, e.g. the parameters of a
flat shard) every segment starts a block of its own: a small-valued bias then never shares a
block, and so a scale, with a LayerNorm weight of ~1; ``nb = sum(ceil(s / B))``.

Numerics (fp32; the input is first cast to fp32, exactly for bf16/fp16), for each block ``x``
(zero-padded to ``B``): ``amax = max |x|``, ``scale = amax / 127`` (fp32 division),
``q = clamp(round_half_even(x / scale), -127, 127)`` (``q = 0`` where ``scale == 0``);
dequantized ``q * scale`` in fp32, then cast to the output dtype (round to nearest even). Every
step is a correctly rounded IEEE operation, so CPU and CUDA give the same bits; the numpy reference
of tests/test_quantize.py checks them bit for bit. Non-finite inputs are not supported (a block
holding inf or NaN dequantizes to NaN or 0).

These are torch operations (they run on CPU and CUDA tensors alike, on the current stream), not a
compcomm C++/CUDA kernel: a fused kernel pair is future work (docs/fsdp.md).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

__all__ = ["DEFAULT_BLOCK", "payload_bytes", "quantize_blockwise", "dequantize_blockwise",
           "round_stochastic"]

#: elements per absmax block: the scale costs 4 / 64 bytes per element (6.3 %); blocks of 64
#: trained better than 256 with FSDP's int8 all-gather on the GPU (docs/fsdp.md)
DEFAULT_BLOCK = 64
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check_block(block: int) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < 4 or block % 4:
        raise ValueError(f"compcomm.quantize: argument 'block' must be an integer >= 4 and a "
                         f"multiple of 4 (the scales stay 4-byte aligned), got {block!r}")


def _blocks(n: int, block: int, segments: Optional[Sequence[int]]) -> int:
    if segments is None:
        return -(-n // block)
    if sum(segments) != n or any(s < 0 for s in segments):
        raise ValueError(f"compcomm.quantize: argument 'segments' must be sizes >= 0 summing to "
                         f"{n}, got sum {sum(segments)}")
    return sum(-(-s // block) for s in segments)


def payload_bytes(n: int, block: int = DEFAULT_BLOCK,
                  segments: Optional[Sequence[int]] = None) -> int:
    """Bytes of the payload of ``n`` elements: ``ceil(n / block) * (4 + block)`` (with
    ``segments``: ``sum(ceil(s / block)) * (4 + block)``)."""
    _check_block(block)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"compcomm.quantize: argument 'n' must be an integer >= 0, got {n!r}")
    return _blocks(n, block, segments) * (4 + block)


def _pieces(segments: Optional[Sequence[int]], n: int, block: int) -> List[Tuple[int, int, int]]:
    """(source offset, block-aligned offset, size) of each non-empty segment."""
    out, src, dst = [], 0, 0
    for s in (segments if segments is not None else [n]):
        if s:
            out.append((src, dst, s))
        src, dst = src + s, dst + -(-s // block) * block
    return out


def quantize_blockwise(x: torch.Tensor, block: int = DEFAULT_BLOCK,
                       out: Optional[torch.Tensor] = None,
                       segments: Optional[Sequence[int]] = None,
                       generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Quantize ``x`` (any shape, fp32/bf16/fp16, read flat) to the payload described above.

    Parameters
    ----------
    x : torch.Tensor
        The values; CPU or CUDA.
    block : int, default 64
        Elements per block (a multiple of 4).
    out : torch.Tensor, optional
        A contiguous uint8 tensor of ``payload_bytes(x.numel(), block, segments)`` elements on
        ``x``'s device.
    segments : sequence of int, optional
        Sizes summing to ``x.numel()``; each starts a new block.
    generator : torch.Generator, optional
        Stochastic rounding: ``q = clamp(floor(x / scale + u), -127, 127)`` with ``u`` uniform in
        [0, 1) drawn from ``generator`` (on ``x``'s device), so that ``E[q * scale] = x``;
        without it, round half to even.

    Returns
    -------
    torch.Tensor
        The payload (``out`` when given), uint8, 1-D.
    """
    _check_block(block)
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
        raise TypeError(f"compcomm.quantize: argument 'x' must be a float32/bfloat16/float16 "
                        f"tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    n = x.numel()
    nb = _blocks(n, block, segments)
    size = nb * (4 + block)
    if out is None:
        out = torch.empty(size, dtype=torch.uint8, device=x.device)
    elif (out.dtype != torch.uint8 or out.numel() != size or out.device != x.device
          or not out.is_contiguous()):
        raise ValueError(f"compcomm.quantize: argument 'out' must be a contiguous uint8 tensor "
                         f"of {size} elements on {x.device}")
    if nb == 0:
        return out
    xf = torch.zeros(nb * block, dtype=torch.float32, device=x.device)
    flat = x.reshape(-1)
    for src, dst, sz in _pieces(segments, n, block):
        xf[dst:dst + sz].copy_(flat[src:src + sz])
    xb = xf.view(nb, block)
    scales = out[:4 * nb].view(torch.float32)
    # a tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal, which
    # rounds differently from the CPU's true division
    torch.div(xb.abs().amax(dim=1), torch.full((1,), 127.0, device=x.device), out=scales)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = xb.div_(safe.unsqueeze(1))
    if generator is None:
        q.round_()
    else:  # unbiased: an update below half a step still moves the expected value
        q.add_(torch.rand(q.shape, generator=generator, device=q.device)).floor_()
    q.clamp_(-127, 127)
    out[4 * nb:].view(torch.int8).view(nb, block).copy_(q)
    return out


def dequantize_blockwise(payload: torch.Tensor, n: int, out: torch.Tensor,
                         block: int = DEFAULT_BLOCK,
                         segments: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Dequantize ``R`` payloads of ``n`` elements each into ``out``.

    Parameters
    ----------
    payload : torch.Tensor
        uint8, ``R * payload_bytes(n, block)`` elements (R payloads end to end, e.g. an
        all-gather's output), on ``out``'s device.
    n : int
        Elements per payload.
    out : torch.Tensor
        ``R * n`` elements (fp32/bf16/fp16), contiguous; row r receives payload r.
    block : int, default 64
    segments : sequence of int, optional
        As given to :func:`quantize_blockwise`.

    Returns
    -------
    torch.Tensor
        ``out``.
    """
    _check_block(block)
    per = payload_bytes(n, block, segments)
    if out.dtype not in _FLOATS or not out.is_contiguous():
        raise TypeError("compcomm.quantize: argument 'out' must be a contiguous "
                        "float32/bfloat16/float16 tensor")
    if n == 0:
        return out
    rows = out.numel() // n
    if payload.dtype != torch.uint8 or payload.numel() != rows * per or rows * n != out.numel():
        raise ValueError(f"compcomm.quantize: argument 'payload' must be uint8 with "
                         f"{per} bytes per {n} elements of 'out' ({out.numel()} elements)")
    nb = per // (4 + block)
    p = payload.reshape(rows, per)
    scales = p[:, :4 * nb].view(torch.float32)
    q = p[:, 4 * nb:].view(torch.int8).view(rows, nb, block)
    deq = q.to(torch.float32).mul_(scales.unsqueeze(2)).view(rows, nb * block)
    rows_out = out.view(rows, n)
    for src, dst, sz in _pieces(segments, n, block):
        rows_out[:, src:src + sz].copy_(deq[:, dst:dst + sz])
    return out


def round_stochastic(x: torch.Tensor, dtype: torch.dtype,
                     generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``x`` (fp32) cast to ``dtype``, rounded stochastically when ``dtype`` is bfloat16.

    bfloat16 is the upper half of float32: a uniform 16-bit integer is added to the magnitude
    bits of ``x`` and the lower half cleared, so each value goes to one of its two bfloat16
    neighbours with probabilities that make the cast unbiased (``E[y] = x``): an update below half
    a bfloat16 step still moves the expected weight (round to nearest would leave it put).
    Other dtypes, or ``generator=None``: the ordinary cast (round to nearest even). Finite inputs
    only (the largest finite values may round up to inf).

    Parameters
    ----------
    x : torch.Tensor
        float32, any shape, CPU or CUDA.
    dtype : torch.dtype
    generator : torch.Generator, optional
        On ``x``'s device; the draws are one int per element in ``x``'s (flat) order.

    Returns
    -------
    torch.Tensor
        A new tensor of ``dtype``, ``x``'s shape.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"compcomm.quantize: argument 'x' must be float32, got {x.dtype}")
    if dtype != torch.bfloat16 or generator is None:
        return x.to(dtype)
    bits = x.contiguous().view(torch.int32)
    r = torch.randint(0, 1 << 16, x.shape, generator=generator, dtype=torch.int32,
                      device=x.device)
    # int32 addition on the bit pattern adds to the magnitude for either sign; then truncate
    return bits.add(r).bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)
