"""A pure-numpy oracle of the 1-bit compressed allreduce (ONEBIT_SPEC.md section a), simulating W ranks
in one process. x = m + e is formed in float32 as the spec says; norms and the server sums are
accumulated in float64, so this is the "float64-accumulated reference" the C++ result is held to."""

from __future__ import annotations

import math
from typing import Dict, List

import numpy as np


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
        return np.float32(0)
    norm = np.float32(np.sqrt(np.sum(x.astype(np.float64) ** 2)))
    return np.float32(norm / np.float32(np.sqrt(np.float64(x.size))))


def simulate(
    ms: List[np.ndarray], worker_errors: List[np.ndarray], server_errors: List[np.ndarray]
) -> Dict[str, object]:
    """One compressed allreduce over W simulated ranks.

    ms[r]: rank r's input as float32 (already rounded to the input dtype), n elements.
    worker_errors[r]: float32, P elements; server_errors[r]: float32, P/W elements.
    Returns the output (float64, n), the new worker/server errors (float64), each rank's packed
    worker signs, the worker scales sigma, the server values c (float64) and scales tau.
    """
    world = len(ms)
    n = ms[0].size
    p = worker_errors[0].size
    chunk = p // world
    xs, sigmas, worker_signs, new_we = [], [], [], []
    for m, e in zip(ms, worker_errors):
        x = np.zeros(p, np.float32)
        x[:n] = m
        x = (x + e).astype(np.float32)
        sigma = worker_scale(x)
        s = sign(x)
        xs.append(s)
        sigmas.append(sigma)
        worker_signs.append(pack_signs(x))
        new_we.append(x.astype(np.float64) - np.float64(sigma) * s)
    inv = np.float32(1.0) / np.float32(world)
    weights = [np.float64(np.float32(sigma * inv)) for sigma in sigmas]
    out = np.zeros(p, np.float64)
    new_se, cs, taus = [], [], []
    for j in range(world):
        sl = slice(j * chunk, (j + 1) * chunk)
        c = sum(xs[i][sl] * weights[i] for i in range(world)) + server_errors[j].astype(np.float64)
        tau = np.sqrt(np.sum(c**2)) / np.sqrt(chunk) if chunk else 0.0
        sc = sign(c)
        out[sl] = tau * sc
        new_se.append(c - tau * sc)
        cs.append(c)
        taus.append(tau)
    return {
        "out": out[:n],
        "worker_errors": new_we,
        "server_errors": new_se,
        "worker_signs": worker_signs,
        "sigmas": sigmas,
        "c": cs,
        "taus": taus,
    }
