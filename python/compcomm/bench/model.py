"""An alpha-beta cost model of plain and compressed allreduce, fitted from measured points.

Fitted model (per network profile and world size W, all times in seconds)
---------------------------------------------------------------------------
Plain allreduce of ``B`` wire bytes per rank (``B = 2(W-1)/W * S`` for a ring of ``S`` bytes)::

    t_plain(B) = alpha + beta * B

``alpha`` lumps the 2(W-1) message latencies, ``beta`` is seconds per wire byte (network plus the
reduction's memory traffic; on a CPU-bound profile the second dominates). One fit per dtype. gloo
switches allreduce algorithm with message size, so the plain fit may be two such lines split at a
size (chosen from the data when it lowers the largest error); ``alpha``/``beta`` are then the
large-size segment's (the asymptotic bandwidth) and ``small`` holds the other.

Compressed allreduce of ``n`` elements, ``B_c`` wire bytes, compression compute ``C(n)`` (measured in
the same run by replaying the call with the network replaced by copies)::

    t_comp(n) = alpha_c + beta * B_c + gamma * C(n)

``beta`` is the fp32 fit's; ``alpha_c`` (four collectives instead of one) and ``gamma`` (how much of
the compute does not overlap; ~1) are fitted. Every fit minimises the largest *relative* error
(minimax), so small and large sizes count alike; :func:`fit` reports the largest relative error on the
points it was fitted on (the test requires <= 20%).

Projection to a cluster (:func:`project`)
-----------------------------------------
``N`` nodes of ``G`` GPUs, inter-node links of ``link_gbit`` Gbit/s per NIC, ``nics`` NICs per node,
one-way latency ``latency_us`` per message, intra-node bandwidth ``intra_GBps``:

* plain (hierarchical, as NCCL): intra-node reduce-scatter/all-gather ``2(G-1)/G * S / intra`` plus an
  inter-node ring ``2(N-1) * lat + 2(N-1)/N * S / (nics * link)``;
* compressed (DeepSpeed's 1-bit allreduce over all ``P = N*G`` ranks, flat, as compcomm does it):
  per node ``G * 2(P-G)/P * S/32`` bytes leave through its NICs, ``2(G-1)/P * S/32`` per GPU stay on
  the intra-node fabric, four collectives of ``P-1`` latency steps each, plus the compression compute
  ``n * compute_ns_per_elt``;
* no overlap of communication with compute, no congestion, no protocol overhead beyond the bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "Fit",
    "fit",
    "fit_rows",
    "Cluster",
    "PRESETS",
    "project",
    "crossover",
    "ASSUMPTIONS",
    "GPU_COMPUTE_NS_PER_ELT",
]

#: Assumed compression compute on a GPU (no GPU here to measure it): ~5 passes of 4-byte fp32 data
#: (read x and the error, write the error and the output, re-read for the server part) at an
#: effective 1.5 TB/s, i.e. ~13 ps per element.
GPU_COMPUTE_NS_PER_ELT = 5 * 4 / 1500.0

ASSUMPTIONS = """\
Assumptions of the projection (labelled PROJECTION wherever shown; nothing here was measured on a cluster):
- alpha-beta links: time = latency per message step + bytes / bandwidth; no congestion, no
  protocol/header overhead beyond the bytes themselves, full-duplex links.
- plain fp32/fp16 allreduce: hierarchical as NCCL: intra-node 2(G-1)/G*S over the intra-node fabric,
  then an inter-node ring 2(N-1)/N*S over nics*link per node, 2(N-1) latency steps.
- compressed: DeepSpeed's 1-bit allreduce over all P=N*G ranks (flat, as compcomm): ~2(P-1)/P*S/32
  bytes per rank, the off-node share (P-G)/(P-1) of them through the node's NICs; 4 collectives of
  (P-1) latency steps; plus compression compute n*c (c in ns/element; 'measured' = this machine's CPU
  kernels from the benchmark run, 'gpu' = an assumed rate, no GPU was measured).
- no overlap of compression compute with communication.
"""


@dataclasses.dataclass
class Fit:
    """Fitted coefficients for one (profile, world size).

    Attributes
    ----------
    alpha, beta : dict
        Per plain method (``gloo_fp32``, ``gloo_fp16``): seconds, seconds per wire byte (the
        large-size segment).
    small : dict
        Per plain method, optional ``(below_wire_bytes, alpha, beta)`` of the small-size segment.
    alpha_c, gamma : float
        Compressed-call latency term and compute weight.
    compute_ns_per_elt : float
        Measured compression compute per element at the largest size (for projections).
    max_rel_err : float
        Largest ``|model - measured| / measured`` over the fitted points.
    """

    profile: str
    world_size: int
    alpha: Dict[str, float]
    beta: Dict[str, float]
    alpha_c: float = float("nan")
    gamma: float = float("nan")
    compute_ns_per_elt: float = float("nan")
    max_rel_err: float = 0.0
    errors: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    small: Dict[str, Tuple[float, float, float]] = dataclasses.field(default_factory=dict)

    def predict(self, row: Dict[str, Any]) -> float:
        """Model time (s) of a measured row (needs its ``method``, ``wire_bytes``, ``compute_s``)."""
        if row["method"] == "compressed":
            return (
                self.alpha_c
                + self.beta["gloo_fp32"] * row["wire_bytes"]
                + self.gamma * row["compute_s"]
            )
        method, wire = row["method"], row["wire_bytes"]
        if method in self.small and wire < self.small[method][0]:
            return self.small[method][1] + self.small[method][2] * wire
        return self.alpha[method] + self.beta[method] * wire


def _wls(x: np.ndarray, t: np.ndarray, scale: Optional[np.ndarray] = None) -> np.ndarray:
    """Coefficients ``c >= 0`` of ``x @ c ~ t`` minimising the largest error relative to ``scale``
    (default ``t``): Lawson's iteratively reweighted least squares, which converges to the minimax
    (Chebyshev) fit -- the criterion the model is held to is its largest relative error."""
    scale = t if scale is None else scale
    a, b = x / scale[:, None], t / scale
    def solve(w: np.ndarray) -> np.ndarray:
        sw = np.sqrt(w)
        c, *_ = np.linalg.lstsq(a * sw[:, None], b * sw, rcond=None)
        if np.any(c < 0):  # a negative latency or bandwidth term is unphysical: refit without it
            keep = c >= 0
            c = np.zeros_like(c)
            if keep.any():
                c[keep], *_ = np.linalg.lstsq((a * sw[:, None])[:, keep], b * sw, rcond=None)
        return c

    w = np.full(len(t), 1.0 / len(t))
    c = solve(w)
    for _ in range(200):
        r = np.abs(a @ c - b)
        if r.max() <= 1e-12:  # (near) exact fit, e.g. as many points as coefficients
            break
        w = w * r + 1e-12 * w.max()  # keep every point weighted, so the system stays solvable
        w = w / w.sum()
        try:
            c = solve(w)
        except np.linalg.LinAlgError:
            break
    return c


def fit(rows: Sequence[Dict[str, Any]]) -> Fit:
    """Fit the model to the rows of one (profile, world size).

    Parameters
    ----------
    rows : sequence of dict
        Rows from :func:`compcomm.bench.runner.run_sweep` (``method``, ``time_s``, ``wire_bytes``,
        ``count``; compressed rows also ``compute_s``), all of one profile and world size.

    Returns
    -------
    Fit
    """
    if not rows:
        raise ValueError("fit: argument 'rows' is empty")
    profiles = {(r["profile"], r["world_size"]) for r in rows}
    if len(profiles) != 1:
        raise ValueError(f"fit: argument 'rows' mixes profiles/world sizes {sorted(profiles)}")
    profile, world = profiles.pop()
    f = Fit(profile, world, {}, {})
    for method in sorted({r["method"] for r in rows} - {"compressed"}):
        pts = sorted((r for r in rows if r["method"] == method), key=lambda r: r["wire_bytes"])
        x = np.array([[1.0, r["wire_bytes"]] for r in pts])
        t = np.array([r["time_s"] for r in pts])
        c = _wls(x, t)
        best = (float(np.max(np.abs(x @ c - t) / t)), c, None)
        for k in range(3, len(pts) - 2):  # two lines, at least 3 points each
            lo, hi = _wls(x[:k], t[:k]), _wls(x[k:], t[k:])
            err = max(np.max(np.abs(x[:k] @ lo - t[:k]) / t[:k]), np.max(np.abs(x[k:] @ hi - t[k:]) / t[k:]))
            if err < best[0] - 0.01:  # a split must earn its two extra coefficients
                best = (float(err), hi, (float(pts[k]["wire_bytes"]), float(lo[0]), float(lo[1])))
        f.alpha[method], f.beta[method] = float(best[1][0]), float(best[1][1])
        if best[2] is not None:
            f.small[method] = best[2]
    comp = [r for r in rows if r["method"] == "compressed"]
    if comp:
        beta = f.beta.get("gloo_fp32", 0.0)
        x = np.array([[1.0, r["compute_s"]] for r in comp])
        t = np.array([r["time_s"] - beta * r["wire_bytes"] for r in comp])
        t_true = np.array([r["time_s"] for r in comp])
        c = _wls(x, t, t_true)
        f.alpha_c, f.gamma = float(c[0]), float(c[1])
        f.beta.setdefault("gloo_fp32", beta)
        big = max(comp, key=lambda r: r["count"])
        f.compute_ns_per_elt = big["compute_s"] / big["count"] * 1e9
    for r in rows:
        p = f.predict(r)
        err = (p - r["time_s"]) / r["time_s"]
        f.errors.append(
            dict(
                method=r["method"], count=r["count"], measured_s=r["time_s"], model_s=p, rel_err=err
            )
        )
    f.max_rel_err = max(abs(e["rel_err"]) for e in f.errors)
    return f


def fit_rows(rows: Sequence[Dict[str, Any]]) -> List[Fit]:
    """:func:`fit` for every (profile, world size) present in ``rows``; the model is gloo's, so
    the ``mpi_*`` methods' rows are left out."""
    rows = [r for r in rows if not r["method"].startswith("mpi_")]
    keys = sorted({(r["profile"], r["world_size"]) for r in rows})
    return [fit([r for r in rows if (r["profile"], r["world_size"]) == k]) for k in keys]


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A described cluster for :func:`project`.

    Attributes
    ----------
    name : str
    nodes, gpus_per_node : int
    link_gbit : float
        Inter-node bandwidth per NIC, Gbit/s.
    nics_per_node : int
    latency_us : float
        Per message step, microseconds.
    intra_GBps : float
        Intra-node (NVLink/PCIe) bandwidth per GPU, GB/s.
    """

    name: str
    nodes: int = 4
    gpus_per_node: int = 8
    link_gbit: float = 100.0
    nics_per_node: int = 1
    latency_us: float = 10.0
    intra_GBps: float = 150.0

    def with_(self, **kw: Any) -> "Cluster":
        """A copy with some fields replaced (None values are ignored)."""
        return dataclasses.replace(self, **{k: v for k, v in kw.items() if v is not None})


#: Ethernet presets: one NIC per node, TCP/RoCE-ish latency; InfiniBand: one HCA per GPU.
PRESETS: Dict[str, Cluster] = {
    "10gbe": Cluster("10 GbE", link_gbit=10, nics_per_node=1, latency_us=25),
    "25gbe": Cluster("25 GbE", link_gbit=25, nics_per_node=1, latency_us=20),
    "40gbe": Cluster("40 GbE", link_gbit=40, nics_per_node=1, latency_us=15),
    "100gbe": Cluster("100 GbE", link_gbit=100, nics_per_node=1, latency_us=10),
    "hdr": Cluster(
        "HDR InfiniBand (200 Gb/s, 1 HCA/GPU)", link_gbit=200, nics_per_node=8, latency_us=2
    ),
    "ndr": Cluster(
        "NDR InfiniBand (400 Gb/s, 1 HCA/GPU)", link_gbit=400, nics_per_node=8, latency_us=2
    ),
}


def project(cluster: Cluster, numel: int, compute_ns_per_elt: float) -> Dict[str, float]:
    """Projected seconds of one allreduce of ``numel`` elements per GPU on ``cluster``.

    Parameters
    ----------
    cluster : Cluster
    numel : int
        Elements per GPU (the gradient bucket).
    compute_ns_per_elt : float
        Compression compute per element (measured here, or :data:`GPU_COMPUTE_NS_PER_ELT`).

    Returns
    -------
    dict
        ``fp32``, ``fp16``, ``compressed`` (seconds) and ``compressed_comm`` (its network part).
    """
    n_nodes, g = cluster.nodes, cluster.gpus_per_node
    p = n_nodes * g
    lat = cluster.latency_us * 1e-6
    node_bw = cluster.nics_per_node * cluster.link_gbit * 1e9 / 8
    intra = cluster.intra_GBps * 1e9

    def plain(size: float) -> float:
        t = 0.0
        if g > 1:
            t += 2 * (g - 1) / g * size / intra + 2 * (g - 1) * 0.5e-6
        if n_nodes > 1:
            t += 2 * (n_nodes - 1) * lat + 2 * (n_nodes - 1) / n_nodes * size / node_bw
        return t

    packed = numel / 8.0  # bytes of signs
    comm = 0.0
    if p > 1:
        off_node = g * 2 * (p - g) / p * packed if n_nodes > 1 else 0.0
        on_node = 2 * (g - 1) / p * packed
        comm = off_node / node_bw + on_node / intra + 4 * (p - 1) * (lat if n_nodes > 1 else 0.5e-6)
    compute = numel * compute_ns_per_elt * 1e-9
    return {
        "fp32": plain(4.0 * numel),
        "fp16": plain(2.0 * numel),
        "compressed": comm + compute,
        "compressed_comm": comm,
    }


def crossover(
    cluster: Cluster, compute_ns_per_elt: float, against: str = "fp32"
) -> Tuple[Optional[int], bool]:
    """Smallest power-of-two element count from which compression beats ``against`` on ``cluster``.

    Returns
    -------
    (numel or None, pays_at_large_sizes)
        ``None`` when it never pays between 2^10 and 2^34 elements.
    """
    first = None
    for k in range(10, 35):
        pr = project(cluster, 1 << k, compute_ns_per_elt)
        if pr["compressed"] < pr[against]:
            if first is None:
                first = 1 << k
        else:
            first = None
    big = project(cluster, 1 << 34, compute_ns_per_elt)
    return first, big["compressed"] < big[against]
