"""``compcomm-bench``: compressed vs plain allreduce on network profiles, plots, a cost model.

Examples
--------
Measure (network profiles other than loopback need root)::

    compcomm-bench --profile eth1g --world-size 4 --sizes 2^16..2^26 --out bench/results/eth1g
    compcomm-bench --profile eth1g,eth10g,unshaped,loopback --world-size 2,4 --out bench/results

Training benchmark (DDP/ZeRO/1-bit optimizers on a byte-level GPT; see compcomm.bench.train)::

    compcomm-bench train --device cuda --profile eth1g,eth10g --world-size 4 --optimizers all

Project onto clusters with the model fitted on a results file::

    compcomm-bench project --results bench/results/results.json --preset 10gbe,100gbe,hdr
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
import time
from typing import Any, Collection, Dict, List, Optional, Sequence

from .netns import PROFILES

__all__ = ["main", "parse_sizes", "augment", "write_outputs", "run_main", "project_main"]


def _int_expr(s: str) -> int:
    s = s.strip()
    m = re.fullmatch(r"(\d+)\^(\d+)", s)
    if m:
        return int(m.group(1)) ** int(m.group(2))
    m = re.fullmatch(r"(\d+)([KMG]?)", s, re.I)
    if not m:
        raise ValueError(f"not a size: {s!r} (use 65536, 64K, 2^16)")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()]


def parse_sizes(text: str) -> List[int]:
    """Element counts from ``"2^16..2^26"`` (every power of two between), ``"2^16,2^20"`` or ``"64K"``.

    Raises
    ------
    ValueError
        Malformed text or a non-positive size (the message names argument ``--sizes``).
    """
    out: List[int] = []
    try:
        for part in text.split(","):
            if ".." in part:
                lo, hi = (_int_expr(x) for x in part.split(".."))
                v = lo
                while v <= hi:
                    out.append(v)
                    v *= 2
            else:
                out.append(_int_expr(part))
    except ValueError as e:
        raise ValueError(f"argument --sizes: {e}") from None
    if not out or min(out) <= 0:
        raise ValueError(f"argument --sizes: need positive sizes, got {text!r}")
    return sorted(set(out))


def augment(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Add nccl-tests columns: algbw, busbw (GB/s, from logical bytes), compression ratio, speedup.

    ``algbw = size_bytes / time`` with ``size_bytes`` the logical (uncompressed) tensor size,
    ``busbw = algbw * 2(W-1)/W``; ``wire_busbw`` is the same from the bytes actually sent;
    ``compression_ratio`` = fp32 ring wire bytes / this method's wire bytes;
    ``speedup_vs_fp32`` = gloo fp32 time / this time at the same count, profile and world size.
    """
    import compcomm

    base = {
        (r["profile"], r["world_size"], r["count"]): r["time_s"]
        for r in rows
        if r["method"] == "gloo_fp32"
    }
    for r in rows:
        w, t = r["world_size"], r["time_s"]
        r["algbw_GBps"] = r["size_bytes"] / t / 1e9
        r["busbw_GBps"] = r["algbw_GBps"] * 2 * (w - 1) / w
        r["wire_GBps"] = r["wire_bytes"] / t / 1e9
        r["compression_ratio"] = compcomm.allreduce_wire_bytes(r["count"], w, 4) / r["wire_bytes"]
        b = base.get((r["profile"], r["world_size"], r["count"]))
        r["speedup_vs_fp32"] = b / t if b else None
    return rows


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            break
        nbytes /= 1024
    return f"{nbytes:.0f} {unit}" if nbytes == int(nbytes) else f"{nbytes:.1f} {unit}"


def _order(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    from .worker import METHODS

    profs, meth = list(PROFILES), list(METHODS)
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
        "speedup = gloo fp32 time / time (same run); #wrong = elements wrong in the checked first call; "
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
    colors = {"compressed": "tab:red", "gloo_fp32": "tab:blue", "gloo_fp16": "tab:green"}
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


def _names(ap: argparse.ArgumentParser, text: str, flag: str, what: str,
           valid: Collection[str]) -> List[str]:
    """The names of a comma list (blanks dropped); ``ap.error`` on one not in ``valid``."""
    names = [v.strip() for v in text.split(",") if v.strip()]
    for v in names:
        if v not in valid:
            ap.error(f"argument --{flag}: unknown {what} {v!r}; choose from {', '.join(valid)}")
    return names


def _meta(argv: Sequence[str]) -> Dict[str, Any]:
    import torch

    import compcomm

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        "compcomm": compcomm.__version__,
        "torch": torch.__version__,
        "command": "compcomm-bench " + " ".join(argv),
        "git_commit": os.environ.get("COMPCOMM_GIT_COMMIT"),
    }


def run_main(argv: Sequence[str]) -> int:
    """The measuring command (the default); see ``compcomm-bench --help``."""
    from . import netns, runner, worker

    ap = argparse.ArgumentParser(prog="compcomm-bench", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--profile",
        default="loopback",
        help=f"comma list of {', '.join(netns.PROFILES)} (namespace profiles need root)",
    )
    ap.add_argument("--world-size", default="2", help="comma list of rank counts, e.g. 2,4")
    ap.add_argument(
        "--sizes", default="2^16..2^26", help="element counts: 2^16..2^26, 2^20,2^24 or 64K"
    )
    ap.add_argument(
        "--methods",
        default=",".join(worker.METHODS),
        help="comma list of " + ", ".join(worker.METHODS),
    )
    ap.add_argument(
        "--target-time", type=float, default=1.0, help="seconds of timed calls per point"
    )
    ap.add_argument("--min-iters", type=int, default=3)
    ap.add_argument("--max-iters", type=int, default=1000)
    ap.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds per sweep before it is killed"
    )
    ap.add_argument("--out", default="bench/results", help="output folder")
    ap.add_argument("--name", default="results", help="file stem of the outputs")
    ap.add_argument(
        "--append",
        action="store_true",
        help="merge into an existing <name>.json (same profile/W/method/count replaced)",
    )
    ap.add_argument(
        "--cleanup-stale",
        action="store_true",
        help="delete leftover namespaces of dead runs and exit",
    )
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    if args.cleanup_stale:
        netns.check_privileges()
        print("deleted:", netns.cleanup_stale() or "nothing")
        return 0
    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as e:
        ap.error(str(e))
    profiles = _names(ap, args.profile, "profile", "profile", netns.PROFILES)
    methods = _names(ap, args.methods, "methods", "method", worker.METHODS)
    try:
        worlds = [int(w) for w in args.world_size.split(",")]
    except ValueError:
        ap.error(f"argument --world-size: need integers, got {args.world_size!r}")
    if any(w < 2 for w in worlds):
        ap.error("argument --world-size: need at least 2 ranks")
    if any(netns.PROFILES[p].netns for p in profiles):
        try:
            netns.check_privileges()
        except netns.NetnsError as e:
            print(f"compcomm-bench: {e}", file=sys.stderr)
            return 2

    meta = _meta(argv)
    total = len(profiles) * len(worlds) * len(sizes) * len(methods)
    bar = None
    if not args.no_progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="pt", desc="compcomm-bench", file=sys.stderr)
        except ImportError:
            bar = None
    rows: List[Dict[str, Any]] = []
    t0 = time.time()
    try:
        for prof in profiles:
            for w in worlds:

                def on_row(r: Dict[str, Any]) -> None:
                    if bar is not None:
                        bar.set_postfix_str(
                            f"{r['profile']} W={r['world_size']} {r['method']} n={r['count']}"
                        )
                        bar.update(1)

                rows += runner.run_sweep(
                    prof,
                    w,
                    sizes,
                    methods,
                    target_time=args.target_time,
                    min_iters=args.min_iters,
                    max_iters=args.max_iters,
                    timeout=args.timeout,
                    on_row=on_row,
                )
    finally:
        if bar is not None:
            bar.close()
    meta["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    meta["wall_s"] = round(time.time() - t0, 1)
    json_path = os.path.join(args.out, f"{args.name}.json")
    if args.append and os.path.exists(json_path):
        with open(json_path) as fh:
            old = json.load(fh)
        new_keys = {(r["profile"], r["world_size"], r["method"], r["count"]) for r in rows}
        rows = [
            r
            for r in old["rows"]
            if (r["profile"], r["world_size"], r["method"], r["count"]) not in new_keys
        ] + rows
        meta["previous_runs"] = old["meta"].get("previous_runs", []) + [
            {k: v for k, v in old["meta"].items() if k != "previous_runs"}
        ]
    paths = write_outputs(rows, meta, args.out, args.name)
    with open(paths["md"]) as fh:
        print(fh.read())
    print("wrote " + ", ".join(paths.values()))
    return 0 if all(r["wrong"] == 0 for r in rows) else 1


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


def project_main(argv: Sequence[str]) -> int:
    """``compcomm-bench project``: the cost model's projected table for described clusters."""
    from . import model

    ap = argparse.ArgumentParser(prog="compcomm-bench project", description=project_main.__doc__)
    ap.add_argument(
        "--results", default="bench/results/results.json", help="measured results to fit (JSON)"
    )
    ap.add_argument(
        "--preset", default="10gbe,100gbe,hdr", help="comma list of " + ", ".join(model.PRESETS)
    )
    ap.add_argument("--nodes", type=int)
    ap.add_argument("--gpus-per-node", type=int)
    ap.add_argument("--link-gbit", type=float)
    ap.add_argument("--nics-per-node", type=int)
    ap.add_argument("--latency-us", type=float)
    ap.add_argument("--intra-GBps", type=float)
    ap.add_argument("--sizes", default="2^16..2^28", help="elements per GPU")
    ap.add_argument("--compute", default="both", help="measured | gpu | both | <ns per element>")
    ap.add_argument("--out", help="also write the markdown here")
    args = ap.parse_args(argv)
    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as e:
        ap.error(str(e))
    fits = []
    if args.results and os.path.exists(args.results):
        with open(args.results) as fh:
            fits = model.fit_rows(json.load(fh)["rows"])
    elif args.compute == "measured":
        ap.error(f"argument --results: {args.results} not found (needed for --compute measured)")
    clusters = []
    for name in _names(ap, args.preset, "preset", "preset", model.PRESETS):
        clusters.append(
            model.PRESETS[name].with_(
                nodes=args.nodes,
                gpus_per_node=args.gpus_per_node,
                link_gbit=args.link_gbit,
                nics_per_node=args.nics_per_node,
                latency_us=args.latency_us,
                intra_GBps=args.intra_GBps,
            )
        )
    text = project_table(fits, clusters, sizes, args.compute)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``compcomm-bench`` (``project`` as first argument: the projection; ``train``:
    the training benchmark, :mod:`compcomm.bench.train`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "project":
        return project_main(argv[1:])
    if argv and argv[0] == "train":
        from .train import main as train_main

        return train_main(argv[1:])
    if argv and argv[0] == "run":
        argv = argv[1:]
    return run_main(argv)


if __name__ == "__main__":
    sys.exit(main())
