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

from .sweep_report import augment, project_table, write_outputs

# importable from here as before the split
from .sweep_report import markdown, plot  # noqa: F401

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
    if out and min(out) <= 0:
        raise ValueError(f"argument --sizes: need positive sizes, got {text!r}")
    if not out:  # "2^20..2^10": lo above hi
        raise ValueError(f"argument --sizes: the range {text!r} is empty (write it low..high)")
    return sorted(set(out))


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
        help="comma list of " + ", ".join(worker.ALL_METHODS) + " (mpi_*: the ranks are started "
        "by Open MPI's mpirun and MPI runs over TCP on the profile's links)",
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
    methods = _names(ap, args.methods, "methods", "method", worker.ALL_METHODS)
    try:
        worlds = [int(w) for w in args.world_size.split(",")]
    except ValueError:
        ap.error(f"argument --world-size: need integers, got {args.world_size!r}")
    if any(w < 2 for w in worlds):
        ap.error("argument --world-size: need at least 2 ranks")
    if any(w > netns.MAX_WORLD for w in worlds):
        ap.error(f"argument --world-size: at most {netns.MAX_WORLD} ranks (one /24 subnet)")
    if args.min_iters < 1:
        ap.error(f"argument --min-iters: must be >= 1, got {args.min_iters}")
    if args.max_iters < args.min_iters:
        ap.error(f"argument --max-iters: must be >= --min-iters ({args.min_iters}), "
                 f"got {args.max_iters}")
    if any(netns.PROFILES[p].netns for p in profiles):
        try:
            netns.check_privileges()
        except netns.NetnsError as e:
            print(f"compcomm-bench: {e}", file=sys.stderr)
            return 2

    meta = _meta(argv)
    # rows carry their run: speedups are ratios within one run, also after --append
    meta["run_id"] = f"{meta['date']}-{os.getpid()}-{time.time_ns() % 10**9}"
    total = len(profiles) * len(worlds) * len(sizes) * len(methods)
    bar = None
    if not args.no_progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="pt", desc="compcomm-bench", file=sys.stderr)
        except ImportError:
            bar = None
    rows: List[Dict[str, Any]] = []
    failures: List[str] = []
    t0 = time.time()

    def on_row(r: Dict[str, Any]) -> None:  # (rows of a sweep that fails later are kept)
        rows.append(dict(r, run=meta["run_id"]))
        if bar is not None:
            bar.set_postfix_str(f"{r['profile']} W={r['world_size']} {r['method']} n={r['count']}")
            bar.update(1)

    try:
        for prof in profiles:
            for w in worlds:
                try:
                    runner.run_sweep(prof, w, sizes, methods, target_time=args.target_time,
                                     min_iters=args.min_iters, max_iters=args.max_iters,
                                     timeout=args.timeout, on_row=on_row)
                except (runner.SweepError, netns.NetnsError) as e:
                    failures.append(f"{prof} W={w}")
                    print(f"\ncompcomm-bench: {prof} W={w} FAILED: {e}", file=sys.stderr,
                          flush=True)
    except KeyboardInterrupt:
        failures.append("interrupted")
        print("\ncompcomm-bench: interrupted", file=sys.stderr, flush=True)
    finally:
        if bar is not None:
            bar.close()
    if failures:
        meta["failed"] = failures
    if not rows:
        print("compcomm-bench: no results to write", file=sys.stderr)
        return 130 if "interrupted" in failures else 1
    meta["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    meta["wall_s"] = round(time.time() - t0, 1)
    json_path = os.path.join(args.out, f"{args.name}.json")
    if args.append and os.path.exists(json_path):
        with open(json_path) as fh:
            old = json.load(fh)
        new_keys = {(r["profile"], r["world_size"], r["method"], r["count"]) for r in rows}
        earlier = old["meta"].get("run_id") or f"before {meta['run_id']}"  # (rows without one)
        rows = [
            dict(r, run=r.get("run", earlier))
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
    if failures:
        print(f"compcomm-bench: partial results (failed: {', '.join(failures)})", file=sys.stderr)
        return 130 if "interrupted" in failures else 1
    return 0 if all(r["wrong"] == 0 for r in rows) else 1


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
    if args.compute not in ("measured", "gpu", "both"):
        try:
            rate = float(args.compute)
        except ValueError:
            rate = float("nan")
        if not rate > 0 or rate == float("inf"):
            ap.error(f"argument --compute: need measured, gpu, both or a positive number of ns "
                     f"per element, got {args.compute!r}")
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
