"""The outputs of ``compcomm-bench`` (:mod:`compcomm.bench.cli`): the allreduce sweep's nccl-tests
columns, markdown table, plot and files, and the cost model's projected table for clusters.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Sequence

from .netns import PROFILES

__all__ = ["augment", "markdown", "plot", "write_outputs", "project_table"]


def augment(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Add nccl-tests columns: algbw, busbw (GB/s, from logical bytes), compression ratio, speedup.

    ``algbw = size_bytes / time`` with ``size_bytes`` the logical (uncompressed) tensor size,
    ``busbw = algbw * 2(W-1)/W``; ``wire_busbw`` is the same from the bytes actually sent;
    ``compression_ratio`` = fp32 ring wire bytes / this method's wire bytes;
    ``speedup_vs_fp32`` = the fp32 allreduce's time over the same transport (``mpi_fp32`` for the
    ``mpi_*`` methods, ``gloo_fp32`` for the others) / this time at the same count, profile and
    world size, in the same run (rows carry ``run`` since ``--append`` merges runs; rows without
    one are taken as one run); None where that run has no fp32 row.
    """
    import compcomm

    def transport(method: str) -> str:
        return "mpi" if method.startswith("mpi_") else "gloo"

    def key(r: Dict[str, Any]) -> tuple:
        return (r.get("run"), transport(r["method"]), r["profile"], r["world_size"], r["count"])

    base = {key(r): r["time_s"] for r in rows if r["method"] in ("gloo_fp32", "mpi_fp32")}
    for r in rows:
        w, t = r["world_size"], r["time_s"]
        r["algbw_GBps"] = r["size_bytes"] / t / 1e9
        r["busbw_GBps"] = r["algbw_GBps"] * 2 * (w - 1) / w
        r["wire_GBps"] = r["wire_bytes"] / t / 1e9
        r["compression_ratio"] = compcomm.allreduce_wire_bytes(r["count"], w, 4) / r["wire_bytes"]
        b = base.get(key(r))
        r["speedup_vs_fp32"] = b / t if b else None
    return rows


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            break
        nbytes /= 1024
    return f"{nbytes:.0f} {unit}" if nbytes == int(nbytes) else f"{nbytes:.1f} {unit}"


def _order(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    from .worker import ALL_METHODS

    profs, meth = list(PROFILES), list(ALL_METHODS)
    return sorted(
        rows,
        key=lambda r: (
            profs.index(r["profile"]) if r["profile"] in profs else 99,
            r["world_size"],
            r["count"],
            meth.index(r["method"]) if r["method"] in meth else 99,
        ),
    )


def markdown(rows: List[Dict[str, Any]], meta: Dict[str, Any], fits: Sequence[Any] = ()) -> str:
    """The summary table (nccl-tests columns), one section per profile and world size."""
    out = ["# compcomm allreduce benchmark (measured on this machine)", ""]
    out.append(
        f"Host: {meta.get('host')}, {meta.get('cpus')} CPUs, load average before/after "
        f"{meta.get('loadavg_before')} / {meta.get('loadavg_after')}; compcomm {meta.get('compcomm')}, "
        f"torch {meta.get('torch')}; {meta.get('date')}."
    )
    out.append("")
    out.append(
        "size = logical (uncompressed) bytes per rank; wire = bytes one rank sends; algbw = size/time, "
        "busbw = algbw*2(W-1)/W (GB/s, from logical bytes); ratio = fp32 ring wire bytes / wire bytes; "
        "speedup = fp32 allreduce time over the same transport (gloo or MPI) / time (same run); #wrong = elements wrong in the checked first call; "
        "time = median over timed batches of the slowest rank's mean per call."
    )
    keys = []
    for r in _order(rows):
        k = (r["profile"], r["world_size"])
        if k not in keys:
            keys.append(k)
    for prof, w in keys:
        out += ["", f"## {prof}, W = {w}", ""]
        out.append(
            "| size | count | method | time (ms) | algbw GB/s | busbw GB/s | wire | ratio | speedup vs fp32 | #wrong |"
        )
        out.append("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in _order([r for r in rows if (r["profile"], r["world_size"]) == (prof, w)]):
            sp = r.get("speedup_vs_fp32")
            out.append(
                f"| {_human(r['size_bytes'])} | {r['count']} | {r['method']} ({r['dtype']}) | "
                f"{r['time_s'] * 1e3:.2f} | {r['algbw_GBps']:.3f} | {r['busbw_GBps']:.3f} | "
                f"{_human(r['wire_bytes'])} | {r['compression_ratio']:.1f} | "
                f"{'' if sp is None else f'{sp:.2f}x'} | {r['wrong']} |"
            )
    if fits:
        out += [
            "",
            "## Cost-model fit (alpha-beta + measured compute; see compcomm.bench.model)",
            "",
        ]
        out.append(
            "| profile | W | fp32 alpha (ms) | fp32 1/beta (Gbit/s) | alpha_c (ms) | gamma | compute ns/elt | max rel. error |"
        )
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        for f in fits:
            b = f.beta.get("gloo_fp32", float("nan"))
            bw = 8 / b / 1e9 if b and b > 0 else float("inf")
            out.append(
                f"| {f.profile} | {f.world_size} | {f.alpha.get('gloo_fp32', float('nan')) * 1e3:.3f} | "
                f"{bw:.2f} | {f.alpha_c * 1e3:.3f} | {f.gamma:.2f} | {f.compute_ns_per_elt:.2f} | "
                f"{f.max_rel_err * 100:.1f}% |"
            )
    return "\n".join(out) + "\n"


def plot(rows: List[Dict[str, Any]], path: str) -> None:
    """Time and busbw vs size: one column per profile, one line per method and world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profs = [p for p in PROFILES if any(r["profile"] == p for r in rows)]
    profs += sorted({r["profile"] for r in rows} - set(profs))
    fig, axes = plt.subplots(2, len(profs), figsize=(4.2 * len(profs), 7), squeeze=False)
    colors = {"compressed": "tab:red", "gloo_fp32": "tab:blue", "gloo_fp16": "tab:green",
              "mpi_compressed": "tab:orange", "mpi_fp32": "tab:purple"}
    styles = {2: "--", 4: "-", 8: ":"}
    for j, prof in enumerate(profs):
        for method, w in sorted(
            {(r["method"], r["world_size"]) for r in rows if r["profile"] == prof}
        ):
            pts = sorted(
                (
                    r
                    for r in rows
                    if (r["profile"], r["method"], r["world_size"]) == (prof, method, w)
                ),
                key=lambda r: r["size_bytes"] if method != "gloo_fp16" else r["count"],
            )
            x = [
                r["count"] * 4 for r in pts
            ]  # fp32-equivalent logical bytes, same x for all methods
            kw = dict(
                color=colors.get(method),
                linestyle=styles.get(w, "-."),
                marker="o",
                markersize=3,
                label=f"{method} W={w}",
            )
            axes[0][j].plot(x, [r["time_s"] * 1e3 for r in pts], **kw)
            axes[1][j].plot(x, [r["busbw_GBps"] for r in pts], **kw)
        axes[0][j].set_title(prof)
        for i in range(2):
            axes[i][j].set_xscale("log", base=2)
            axes[i][j].set_yscale("log")
            axes[i][j].grid(True, which="both", alpha=0.3)
            axes[i][j].set_xlabel("tensor size (fp32 bytes per rank)")
        axes[0][j].set_ylabel("time (ms)")
        axes[1][j].set_ylabel("busbw (GB/s, logical bytes)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("compcomm compressed vs gloo allreduce (measured on this machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(
    rows: List[Dict[str, Any]], meta: Dict[str, Any], out_dir: str, name: str = "results"
) -> Dict[str, str]:
    """Write ``<name>.json``, ``<name>.md`` and ``<name>.png`` into ``out_dir``; return their paths."""
    from . import model

    os.makedirs(out_dir, exist_ok=True)
    rows = _order(augment(rows))
    fits = []
    try:
        fits = model.fit_rows(rows)
    except Exception as e:  # a partial sweep may not be fittable; the table is still useful
        meta = dict(meta, model_error=str(e))
    paths = {k: os.path.join(out_dir, f"{name}.{k}") for k in ("json", "md", "png")}
    doc = {
        "meta": meta,
        "columns": {
            "size_bytes": "logical (uncompressed) bytes of the tensor per rank",
            "wire_bytes": "bytes one rank sends per call (compressed: compcomm.wire_bytes; plain: ring allreduce)",
            "time_s": "median over timed batches of the slowest rank's mean seconds per call",
            "time_mean_s": "mean seconds per call over all timed calls (nccl-tests' figure)",
            "algbw_GBps": "size_bytes / time_s / 1e9",
            "busbw_GBps": "algbw * 2(W-1)/W",
            "wire_GBps": "wire_bytes / time_s / 1e9",
            "compute_s": "compressed only: the same call with the network replaced by local copies",
            "wrong": "elements wrong in the checked first call",
        },
        "rows": rows,
        "model": [{k: v for k, v in vars(f).items()} for f in fits],
    }
    with open(paths["json"], "w") as fh:
        json.dump(doc, fh, indent=1)
    with open(paths["md"], "w") as fh:
        fh.write(markdown(rows, meta, fits))
    plot(rows, paths["png"])
    return paths


def project_table(
    fits: Sequence[Any], clusters: Sequence[Any], sizes: Sequence[int], compute: str
) -> str:
    """Markdown of the projected times (labelled PROJECTION) for every cluster and size."""
    from . import model

    lines = [
        "# PROJECTION (cost model, not measured): compressed vs plain allreduce on clusters",
        "",
    ]
    lines.append("```\n" + model.ASSUMPTIONS + "```")
    measured = None
    if fits:
        pick = sorted(fits, key=lambda f: (f.profile != "loopback", f.world_size != 2))[0]
        measured = pick.compute_ns_per_elt
        lines.append("")
        lines.append(
            f"Calibration: compression compute {measured:.2f} ns/element measured here "
            f"({pick.profile}, W={pick.world_size}, CPU kernels, one core per rank); the fits reproduce "
            f"their measured points within {max(f.max_rel_err for f in fits) * 100:.1f}% (worst of "
            f"{len(fits)} profile/W fits over {sum(len(f.errors) for f in fits)} points)."
        )
    rates = []
    if compute in ("measured", "both") and measured is not None:
        rates.append(("measured CPU", measured))
    if compute in ("gpu", "both") or measured is None:
        rates.append(("assumed GPU", model.GPU_COMPUTE_NS_PER_ELT))
    try:
        rates = rates if compute in ("measured", "gpu", "both") else [("given", float(compute))]
    except ValueError:
        pass
    for c in clusters:
        lines += [
            "",
            f"## {c.name}: {c.nodes} nodes x {c.gpus_per_node} GPUs, {c.nics_per_node} x {c.link_gbit:g} Gbit/s per node, "
            f"{c.latency_us:g} us latency, intra-node {c.intra_GBps:g} GB/s",
            "",
        ]
        head = "| fp32 size per GPU | fp32 (ms) | fp16 (ms) |" + "".join(
            f" compressed, {lab} compute (ms) | speedup vs fp32 | vs fp16 |" for lab, _ in rates
        )
        lines.append(head)
        lines.append("|---:" * (3 + 3 * len(rates)) + "|")
        for n in sizes:
            cells = None
            for lab, rate in rates:
                pr = model.project(c, n, rate)
                if cells is None:
                    cells = [_human(4 * n), f"{pr['fp32'] * 1e3:.3f}", f"{pr['fp16'] * 1e3:.3f}"]
                cells += [
                    f"{pr['compressed'] * 1e3:.3f}",
                    f"{pr['fp32'] / pr['compressed']:.2f}x",
                    f"{pr['fp16'] / pr['compressed']:.2f}x",
                ]
            lines.append("| " + " | ".join(cells or []) + " |")
        for lab, rate in rates:
            for against in ("fp32", "fp16"):
                first, large = model.crossover(c, rate, against)
                if first is None:
                    verdict = "never pays (2^10..2^34 elements)"
                elif large:
                    verdict = f"pays from {_human(4 * first)} of fp32 per GPU up"
                else:
                    verdict = "pays only in a band of sizes"
                lines.append(f"- {lab} compute ({rate:.3g} ns/elt) vs {against}: {verdict}")
    return "\n".join(lines) + "\n"
