"""The replicated momentum of ZeRO + OneBitAdam in its 1-bit form: about P/8 bytes instead of 4 P.

Why it is exact. After a compressed step the momentum is the compressed allreduce's output: per
bucket of ``P`` (padded) elements cut into ``W`` chunks of ``C = P / W``, element ``k`` is
``tau_j * s_k`` with ``j = k // C``, ``s_k = +-1`` and ``tau_j`` the server scale of chunk ``j``,
identical on every rank. So a bucket's momentum is fully described by ``P/8`` bytes of signs and
``W`` fp32 scales, and unpacking gives the same fp32 bits back (``tau * +-1`` is exact). The
compressor hands these over from its exchange records (:meth:`OneBitCompressor.packed_average
<compcomm.compress.OneBitCompressor.packed_average>`), so nothing is re-derived from the values.

Signs are packed 8 per byte, element ``8i + j`` in bit ``7 - j`` (MSB first), bit 1 meaning +1,
the layout of the compression kernels. Elements at or beyond a bucket's ``numel`` (padding: one
bit cannot say 0) unpack to +0, as the fp32 momentum kept them.

CPU tensors run the C++ kernels (``cpp/kernels/packed_momentum.{h,cpp}``); other devices (CUDA)
the torch ops of :func:`unpack_torch` / :func:`pack_torch`, which the tests hold to the kernels on
CPU tensors.
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Tuple

import torch

from .. import _C
from .._buffers import buffer_of

__all__ = ["PackedMomentum", "pack", "pack_torch", "unpack", "unpack_torch"]

_SHIFTS: Dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    s = _SHIFTS.get(device)
    if s is None:
        s = _SHIFTS[device] = torch.arange(7, -1, -1, dtype=torch.uint8, device=device)
    return s


def _check_unpack(signs: torch.Tensor, scales: torch.Tensor, chunk: int, numel: int, begin: int,
                  out: torch.Tensor) -> None:
    fn = "packed_momentum.unpack"
    for name, t, dt in (("signs", signs, torch.uint8), ("scales", scales, torch.float32),
                        ("out", out, torch.float32)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dt:
            raise TypeError(f"{fn}: {name} must be {dt}, got {t.dtype}")
        if not t.is_contiguous() or t.device != out.device:
            raise ValueError(f"{fn}: {name} must be contiguous and on out's device {out.device}")
    if begin < 0 or numel < 0:
        raise ValueError(f"{fn}: begin and numel must be >= 0, got {begin}, {numel}")
    live = min(begin + out.numel(), numel)
    if out.numel() and chunk < 1:
        raise ValueError(f"{fn}: chunk must be >= 1, got {chunk}")
    if live > begin and (signs.numel() * 8 < live or scales.numel() * chunk < live):
        raise ValueError(f"{fn}: signs ({signs.numel()} bytes) / scales ({scales.numel()} chunks "
                         f"of {chunk}) do not cover elements up to {live}")


def unpack_torch(signs: torch.Tensor, scales: torch.Tensor, chunk: int, numel: int, begin: int,
                 out: torch.Tensor, mul: float = 1.0) -> torch.Tensor:
    """:func:`unpack` with torch ops (the path of GPU tensors; any device): the values, then
    ``out.mul_(mul)`` (the operation the kernel folds in)."""
    _check_unpack(signs, scales, chunk, numel, begin, out)
    live = max(0, min(begin + out.numel(), numel) - begin)
    if live:
        lo, hi = begin // 8, (begin + live + 7) // 8
        bits = (signs[lo:hi].unsqueeze(1) >> _shifts(signs.device)) & 1
        bits = bits.reshape(-1)[begin - 8 * lo : begin - 8 * lo + live]
        k = torch.arange(begin, begin + live, device=out.device)
        tau = scales[torch.div(k, chunk, rounding_mode="floor")]
        torch.where(bits.bool(), tau, -tau, out=out[:live])
        if mul != 1.0:
            out[:live].mul_(mul)
    out[live:].zero_()
    return out


def unpack(signs: torch.Tensor, scales: torch.Tensor, chunk: int, numel: int, begin: int,
           out: torch.Tensor, mul: float = 1.0) -> torch.Tensor:
    """Elements ``[begin, begin + out.numel())`` of a packed 1-bit tensor, into ``out``.

    Parameters
    ----------
    signs : torch.Tensor
        uint8, the packed signs (MSB first, bit 1 = +1) of at least the elements unpacked.
    scales : torch.Tensor
        fp32, one scale per chunk of ``chunk`` elements.
    chunk : int
        Elements per scale (the compressed allreduce's ``P / W``).
    numel : int
        Elements that carry values; positions ``>= numel`` (padding) unpack to +0.
    begin : int
        The first element to unpack (``rank * chunk``: one rank's chunk).
    out : torch.Tensor
        fp32, contiguous, on the device of ``signs`` and ``scales``.
    mul : float
        Multiply each value by this (as ``out.mul_(mul)`` would, fp32): 1-bit Adam's ``b1 * m``
        in the same pass.

    Returns
    -------
    torch.Tensor
        ``out``: ``fl(scales[k // chunk] * mul) * (+1 if bit k else -1)`` for
        ``k = begin + i < numel``, +0 beyond ``numel``; exact for ``mul = 1``.
    """
    if out.device.type != "cpu":
        return unpack_torch(signs, scales, chunk, numel, begin, out, mul)
    _check_unpack(signs, scales, chunk, numel, begin, out)
    _C.kernels.unpack_momentum(buffer_of(signs), buffer_of(scales), int(chunk), int(numel),
                               int(begin), buffer_of(out), float(mul))
    return out


def _check_pack(x: torch.Tensor, chunk: int) -> None:
    fn = "packed_momentum.pack"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{fn}: x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.numel() % 8:
        raise ValueError(f"{fn}: x has {x.numel()} elements, not a multiple of 8")
    if x.numel() and (chunk < 1 or x.numel() % chunk):
        raise ValueError(f"{fn}: chunk {chunk} does not divide x's {x.numel()} elements")


def pack_torch(x: torch.Tensor, chunk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack` with torch ops (any device)."""
    _check_pack(x, chunk)
    flat = x.reshape(-1)
    bits = (~(flat < 0)).to(torch.uint8).reshape(-1, 8) << _shifts(x.device)
    signs = bits.sum(dim=1, dtype=torch.uint8) if flat.numel() else torch.empty(
        0, dtype=torch.uint8, device=x.device)
    if flat.numel():
        scales = flat.float().abs().reshape(-1, chunk).amax(dim=1)
    else:
        scales = torch.empty(0, dtype=torch.float32, device=x.device)
    return signs, scales


def pack(x: torch.Tensor, chunk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The packed form of a 1-bit tensor ``x`` (fp32/fp16/bf16, numel a multiple of 8 and of
    ``chunk``): ``(signs, scales)``, uint8 ``numel/8`` with bit k = ``not x_k < 0`` and fp32
    ``numel/chunk`` with the largest ``|x|`` of each chunk. Exact for ``tau_j * s_k`` tensors
    (zero padding included); -0.0 packs as +1. For a momentum whose compressor cannot hand its
    records back."""
    if x.device.type != "cpu":
        return pack_torch(x, chunk)
    _check_pack(x, chunk)
    x = x.contiguous()
    signs = torch.empty(x.numel() // 8, dtype=torch.uint8)
    scales = torch.empty(x.numel() // chunk if x.numel() else 0, dtype=torch.float32)
    _C.kernels.pack_momentum(buffer_of(x.reshape(-1)), int(chunk), buffer_of(signs),
                             buffer_of(scales))
    return signs, scales


class PackedMomentum:
    """The 1-bit momentum of named buckets: per key, the signs and per-chunk scales.

    Every rank holds the same bits (the compressed allreduce's output), so the whole momentum
    is replicated at about ``P/8 + 4 W`` bytes per bucket.
    """

    def __init__(self) -> None:
        # key -> (signs uint8 [P/8], scales fp32 [W], numel, chunk)
        self._b: Dict[Hashable, Tuple[torch.Tensor, torch.Tensor, int, int]] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._b

    def keys(self) -> List[Hashable]:
        """The buckets held."""
        return list(self._b)

    def put(self, key: Hashable, signs: torch.Tensor, scales: torch.Tensor, numel: int,
            chunk: int) -> None:
        """Hold bucket ``key``: ``signs`` (uint8, ``P/8``), ``scales`` (fp32, one per chunk of
        ``chunk`` elements), ``numel`` live elements (the rest is padding). Takes the tensors."""
        if signs.dtype != torch.uint8 or scales.dtype != torch.float32:
            raise TypeError("PackedMomentum.put: signs must be uint8 and scales float32, got "
                            f"{signs.dtype} / {scales.dtype}")
        if signs.numel() * 8 < numel or scales.numel() * chunk < numel:
            raise ValueError(f"PackedMomentum.put: bucket {key!r}: {signs.numel()} sign bytes and "
                             f"{scales.numel()} scales of {chunk} do not cover {numel} elements")
        self._b[key] = (signs, scales, int(numel), int(chunk))

    def get(self, key: Hashable) -> Tuple[torch.Tensor, torch.Tensor, int, int]:
        """Bucket ``key``'s ``(signs, scales, numel, chunk)``."""
        return self._b[key]

    def unpack_(self, key: Hashable, out: torch.Tensor, begin: int = 0,
                mul: float = 1.0) -> torch.Tensor:
        """Bucket ``key``'s fp32 momentum (times ``mul``, see :func:`unpack`), elements
        ``[begin, begin + out.numel())``, into ``out`` (padding +0)."""
        signs, scales, numel, chunk = self._b[key]
        return unpack(signs, scales, chunk, numel, begin, out, mul)

    def drop(self, key: Hashable) -> None:
        """Forget bucket ``key`` (if held)."""
        self._b.pop(key, None)

    def reset(self) -> None:
        """Forget every bucket."""
        self._b.clear()

    def nbytes(self) -> int:
        """Bytes held: signs plus scales."""
        return sum(s.numel() + t.numel() * 4 for s, t, _, _ in self._b.values())

    def state_dict(self) -> Dict[Hashable, Dict[str, torch.Tensor]]:
        """``{key: {"signs", "scales", "numel", "chunk"}}`` (copies, CPU)."""
        return {k: {"signs": s.cpu().clone(), "scales": t.cpu().clone(),
                    "numel": torch.tensor(n), "chunk": torch.tensor(c)}
                for k, (s, t, n, c) in self._b.items()}

    def load_state_dict(self, state: Dict[Hashable, Dict[str, torch.Tensor]],
                        device: Optional[torch.device] = None) -> None:
        """Restore what :meth:`state_dict` returned (onto ``device``)."""
        self._b = {}
        for k, d in state.items():
            self.put(k, d["signs"].to(device), d["scales"].to(device), int(d["numel"]),
                     int(d["chunk"]))
