"""The numpy oracle of the 1-bit compressed allreduce (ONEBIT_SPEC.md section a), simulating W ranks in
one process. It is the one simulation of the algorithm in tests/: the conformance suite, the kernel
tests and the optimizer references (tests/optim_reference.py) all use it.

Two precisions, one algorithm:

- ``"fp64"`` (default): x = m + e is formed in float32 as the spec says; the server sums c, the
  scales tau and the new errors are float64. This is the "float64-accumulated reference" the C++
  result is held to (within a tolerance).
- ``"fp32"``: every step in float32 in the order the spec writes it (the server sum over ranks
  0..W-1, one rounding per addition); only the norms are accumulated in float64. The optimizer
  references use it, so that a simulated training run stays close to the C++ one over many steps.
"""

from __future__ import annotations

import math
from typing import Dict, List

import numpy as np

f32 = np.float32
PRECISIONS = ("fp64", "fp32")


def padded_numel(n: int, world: int) -> int:
    """DeepSpeed's optimizer padding: n rounded up to a multiple of W * lcm(W, 8)."""
    unit = world * (world * 8 // math.gcd(world, 8))
    return -(-n // unit) * unit


def sign(x: np.ndarray) -> np.ndarray:
    """+1 for x >= 0, -0.0 and NaN; -1 only for x < 0."""
    return np.where(x < 0, -1.0, 1.0)


def pack_signs(x: np.ndarray) -> np.ndarray:
    """Packed sign bits, MSB first, bit 1 = +1."""
    return np.packbits(~(x < 0), bitorder="big")


def worker_scale(x: np.ndarray) -> np.float32:
    """fl32(fl32(||x||) / fl32(sqrt(P))) with the sum of squares in float64."""
    if x.size == 0:
        return f32(0)
    norm = f32(np.sqrt(np.sum(x.astype(np.float64) ** 2)))
    return f32(norm / f32(np.sqrt(np.float64(x.size))))


def simulate(
    ms: List[np.ndarray],
    worker_errors: List[np.ndarray],
    server_errors: List[np.ndarray],
    precision: str = "fp64",
) -> Dict[str, object]:
    """One compressed allreduce over W simulated ranks.

    ms[r]: rank r's input as float32 (already rounded to the input dtype), n elements (any shape).
    worker_errors[r]: float32, P elements; server_errors[r]: float32, P/W elements. Not modified.
    Returns the output (n elements) and the new worker/server errors (float64 for ``"fp64"``,
    float32 for ``"fp32"``), each rank's packed worker signs, the worker scales sigma, the server
    values c and scales tau.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"simulate: argument 'precision' must be one of {PRECISIONS}, got {precision!r}")
    exact = precision == "fp64"
    world = len(ms)
    n = ms[0].size
    p = worker_errors[0].size
    chunk = p // world
    signs, sigmas, worker_signs, new_we = [], [], [], []
    for m, e in zip(ms, worker_errors):
        x = np.zeros(p, f32)
        x[:n] = np.reshape(m, -1)
        x = (x + e).astype(f32)
        sigma = worker_scale(x)
        if exact:
            s = sign(x)
            new_we.append(x.astype(np.float64) - np.float64(sigma) * s)
        else:
            s = sign(x).astype(f32)
            new_we.append((x - sigma * s).astype(f32))
        signs.append(s)
        sigmas.append(sigma)
        worker_signs.append(pack_signs(x))
    inv = f32(1.0) / f32(world)
    weights = [f32(sigma * inv) for sigma in sigmas]
    out = np.zeros(p, np.float64 if exact else f32)
    new_se, cs, taus = [], [], []
    for j in range(world):
        sl = slice(j * chunk, (j + 1) * chunk)
        if exact:
            c = sum(signs[i][sl] * np.float64(weights[i]) for i in range(world))
            c = c + server_errors[j].astype(np.float64)
            tau = np.sqrt(np.sum(c**2)) / np.sqrt(chunk) if chunk else 0.0
            sc = sign(c)
        else:
            c = np.zeros(chunk, f32)
            for i in range(world):  # one float32 rounding per addition, ranks in order
                c = (c + signs[i][sl] * weights[i]).astype(f32)
            c = (c + server_errors[j]).astype(f32)
            tau = worker_scale(c)
            sc = sign(c).astype(f32)
        out[sl] = tau * sc
        new_se.append(c - tau * sc if exact else (c - tau * sc).astype(f32))
        cs.append(c)
        taus.append(tau)
    return {
        "out": out[:n],
        "out_padded": out,
        "worker_errors": new_we,
        "server_errors": new_se,
        "worker_signs": worker_signs,
        "sigmas": sigmas,
        "c": cs,
        "taus": taus,
    }


def compressed_allreduce_padded(
    xs: List[np.ndarray], wes: List[np.ndarray], ses: List[np.ndarray], precision: str = "fp32"
) -> np.ndarray:
    """:func:`simulate` with the error-feedback state carried in place, for step-by-step references.

    ``wes``/``ses`` (float32, P and P/W elements per rank) are overwritten with the new errors
    (rounded to float32). Returns the padded output (P elements, float32 for ``"fp32"``),
    identical on all ranks; chunk j (P/W elements) is rank j's reduce-scatter result.
    """
    ref = simulate(xs, wes, ses, precision)
    for mine, new in zip(wes, ref["worker_errors"]):
        mine[:] = new
    for mine, new in zip(ses, ref["server_errors"]):
        mine[:] = new
    return ref["out_padded"]


def compressed_allreduce(
    xs: List[np.ndarray], wes: List[np.ndarray], ses: List[np.ndarray], precision: str = "fp32"
) -> np.ndarray:
    """:func:`compressed_allreduce_padded` cut to the input's n elements."""
    return compressed_allreduce_padded(xs, wes, ses, precision)[: xs[0].size]
