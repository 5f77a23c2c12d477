"""``compcomm-bench train``: data-parallel training of a byte-level GPT on emulated hosts.

Each of ``--world-size`` ranks is a process; on the namespace profiles (``eth1g``, ``eth10g``,
``eth25g``, ``unshaped``; root only) each runs in its own network namespace with a shaped veth into a
bridge (:mod:`compcomm.bench.netns`), so every byte between ranks crosses a 1/10/25 Gbit/s link. On
GPUs (``--device cuda``) every rank is also an emulated host for NCCL: its own ``NCCL_HOSTID``,
``NCCL_SOCKET_IFNAME`` = its veth, IB/P2P/SHM/NVLS off, so NCCL uses its socket transport over the
shaped link; the ranks share the local GPU(s) (``cuda:rank % ngpus``), so compute is time-sliced
between them. On the CPU the ranks use gloo over the same links.

Model: a GPT-style byte-level transformer (pre-norm, causal attention, tied embeddings), ``tiny``
(~8M parameters, CPU) or ``gpt2s`` (d 768, 12 heads, 17 layers, seq 256: ~121M parameters),
trained on the Python standard library's own source (last 10 % held out for validation), bf16
autocast on GPUs with fp32 parameters (the master weights).

Optimizers (``--optimizers``): DDP + AdamW (fp32 or bf16-hook gradients), OneBitAdam, ZeroOneAdam,
OneBitLamb and their uncompressed twins (no freeze; and identity twins: the same schedule with
exact averages), ZeRO-2 + AdamW / OneBitAdam (exact and no-all-gather modes), FSDP2 + AdamW
(bf16) and FSDP2 + compcomm's 1-bit reduce-scatter: the table and how each is built are in
:mod:`compcomm.bench.train_setups`.

Timing (per rank, CUDA-synchronized; all ranks enter every step together after a barrier; the
figure of a step is the slowest rank's): ``fwdbwd`` = zero_grad + forward + backward, ``opt`` =
``optimizer.step()`` (its communication included), ``step`` = both. DDP and ZeRO-2 communicate
inside backward (overlapped), so communication is derived: before the optimizers run, every rank
times ``--compute-steps`` forward+backward passes of the same model with no communication at all
(all ranks at once, so the GPU/CPU sharing is the same): ``compute_s``; then
``comm_s = step_s - compute_s`` (communication plus the optimizer's own arithmetic). Per-step
phases: ``full`` (uncompressed optimizers), ``warmup`` / ``compressed`` (1-bit Adam/LAMB, ZeRO +
OneBitAdam, FSDP2 + 1-bit), ZeroOneAdam's ``var`` / ``grad1bit`` / ``local`` / ``sync``; medians are per phase,
the first step of a phase left out when the phase has 3 or more steps, and steps after a
divergence (loss non-finite or above 3x the first step's; the optimizer then stops) left out.

Bytes per step: what rank 0's compcomm communicator counted (``Communicator.bytes_sent``: the
sender's share of each collective, ring allreduce = ``2(W-1)/W`` of the buffer); for DDP, which
talks to torch directly, the ring formula ``2(W-1)/W * gradient bytes`` (fp32, or bf16 with the
hook); FSDP2's collectives are counted as they are called (see :mod:`.train_setups`). The loss logging allreduce is not counted. Validation loss on held-out text every
``--eval-every`` steps (not in the timed wall clock).

Outputs in ``--out``: ``<name>.json`` (every step), ``<name>.md`` (the table), ``<name>.png``
(loss against step, wall time and bytes; step time split into compute and communication).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from .netns import MAX_WORLD, PROFILES
from .train_rank import MODELS, build_model, rank_main
from .train_report import fmt_bytes, summarize, write_outputs
from .train_setups import OPTIMIZERS

# importable from here as before the split (tests and bench/ scripts use some of them)
from .train_rank import load_text, param_count  # noqa: F401
from .train_report import loss_checks, markdown, plot, targets, time_to_target  # noqa: F401
from .train_setups import COMPRESSED, IDENTITY_TWIN, TWIN, make, phase  # noqa: F401

__all__ = ["main", "OPTIMIZERS", "MODELS", "build_model", "summarize", "write_outputs"]


# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="compcomm-bench train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--profile", default="loopback",
                    help=f"comma list of {', '.join(PROFILES)} (namespace profiles need root)")
    ap.add_argument("--world-size", default="2", help="comma list of rank counts, e.g. 2,4")
    ap.add_argument("--model", choices=list(MODELS), default=None,
                    help="tiny (~8M, default on cpu) or gpt2s (~121M, default on cuda)")
    ap.add_argument("--d-model", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--batch", type=int, default=None,
                    help="sequences per rank per step (default: 8 on cuda, 2 on cpu)")
    ap.add_argument("--optimizers", default="ddp_adamw,onebitadam",
                    help="comma list of " + ", ".join(OPTIMIZERS) + ", or 'all'")
    ap.add_argument("--steps", type=int, default=20, help="steps per optimizer")
    ap.add_argument("--baseline-steps", type=int, default=None,
                    help="steps for the uncompressed optimizers (default: --steps)")
    ap.add_argument("--warmup", type=int, default=5,
                    help="freeze_step (1-bit Adam/LAMB) and var_freeze_step (0/1 Adam)")
    ap.add_argument("--max-seconds", type=float, default=0.0,
                    help="stop an optimizer's run after this many seconds (0: never)")
    ap.add_argument("--timing-only", action="store_true",
                    help="no validation evaluations during the run (only the final one)")
    ap.add_argument("--eval-every", type=int, default=10, help="validation every N steps")
    ap.add_argument("--val-batches", type=int, default=8, help="held-out batches per evaluation")
    ap.add_argument("--target-val-loss", type=float, default=None,
                    help="for time-to-target (default: the highest final validation loss)")
    ap.add_argument("--compute-steps", type=int, default=3,
                    help="forward+backward passes without communication (the compute reference)")
    ap.add_argument("--lr", type=float, default=None, help="Adam-family lr (6e-4 gpt2s, 2e-3 tiny)")
    ap.add_argument("--lamb-lr", type=float, default=None, help="LAMB lr (default: 2 x --lr)")
    ap.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                    help="constant lr, or a linear ramp over --lr-warmup steps then a cosine decay "
                         "to 0.1 x lr at the last step (the usual GPT pre-training schedule)")
    ap.add_argument("--lr-warmup", type=int, default=0,
                    help="steps of the linear lr ramp (--lr-schedule cosine)")
    ap.add_argument("--amp", choices=("bf16", "none"), default=None,
                    help="autocast dtype (default: bf16 on cuda, none on cpu)")
    ap.add_argument("--backend", choices=("torch", "nccl", "mpi"), default="torch",
                    help="compcomm optimizers over the torch group (default), compcomm's native "
                         "NCCL communicator (comm_backend_name='nccl'; cuda only) or its MPI "
                         "communicator (comm_backend_name='mpi': the ranks run under mpirun, MPI "
                         "over TCP on the profile's links; host-staged on cuda)")
    ap.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                    help="OneBitAdam/ZeroOneAdam fused= (default: the optimizer's default)")
    ap.add_argument("--reduce-bucket-size", type=float, default=None,
                    help="the 1-bit optimizers' reduce_bucket_size in elements, e.g. 16777216 or 1.6e7 "
                         "(default: the optimizer's default)")
    ap.add_argument("--overlap-backward", action="store_true",
                    help="also run onebitadam_overlap, OneBitAdam(overlap_backward=True), right "
                         "after onebitadam (both are added if onebitadam is not listed)")
    ap.add_argument("--overlap-groups", type=int, default=None,
                    help="about how many groups the backward overlap sends per step "
                         "(compcomm.optim.overlap.MAX_GROUPS in every rank; default: its value)")
    ap.add_argument("--bias-correction", action="store_true",
                    help="bias_correction=True for the 1-bit optimizers (default: their default)")
    ap.add_argument("--local-step-scaler", type=int, default=None,
                    help="ZeroOneAdam local_step_scaler (default: its default, 32678: no local "
                         "steps in a short run)")
    ap.add_argument("--local-step-clipper", type=int, default=None)
    ap.add_argument("--fsdp-bf16", action="store_true",
                    help="FSDP2 rows: bf16 parameters and reduction (MixedPrecisionPolicy) on the "
                         "CPU too, as on GPUs (default there)")
    ap.add_argument("--fsdp-unbatched", action="store_true",
                    help="fsdp2_onebit* rows: one compressed reduce-scatter per segment "
                         "(OneBitFSDP.batch_segments=False: the same bits, another code path)")
    ap.add_argument("--ag-options", default="",
                    help="keyword arguments of compcomm.fsdp.compressed_allgather for the rows "
                         "with compcomm's all-gather, e.g. 'exact_numel=0,rounding=nearest,"
                         "block=256' (default: its defaults)")
    ap.add_argument("--seed", type=int, default=0,
                    help="model initialisation and training batches (the validation batches are "
                         "the same for every seed, so losses of different seeds compare)")
    ap.add_argument("--data-bytes", type=int, default=4_000_000)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per CPU rank")
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="seconds per (profile, W) run before its ranks are killed")
    ap.add_argument("--out", default="bench/results", help="output folder")
    ap.add_argument("--name", default=None, help="file stem (default train_<device>)")
    ap.add_argument("--progress", action="store_true", help="print every step")
    a = ap.parse_args(list(argv))
    a.profiles = [p.strip() for p in a.profile.split(",") if p.strip()]
    for p in a.profiles:
        if p not in PROFILES:
            ap.error(f"argument --profile: unknown profile {p!r}; choose from {', '.join(PROFILES)}")
    try:
        a.worlds = [int(w) for w in a.world_size.split(",")]
    except ValueError:
        ap.error(f"argument --world-size: need integers, got {a.world_size!r}")
    if any(w < 2 for w in a.worlds):
        ap.error("argument --world-size: need at least 2 ranks")
    if any(w > MAX_WORLD for w in a.worlds):
        ap.error(f"argument --world-size: at most {MAX_WORLD} ranks (one /24 subnet)")
    a.opt_list = list(OPTIMIZERS) if a.optimizers.strip() == "all" else \
        [o.strip() for o in a.optimizers.split(",") if o.strip()]
    if a.overlap_backward and "onebitadam_overlap" not in a.opt_list:
        if "onebitadam" not in a.opt_list:
            a.opt_list.append("onebitadam")
        a.opt_list.insert(a.opt_list.index("onebitadam") + 1, "onebitadam_overlap")
    for o in a.opt_list:
        if o not in OPTIMIZERS:
            ap.error(f"argument --optimizers: unknown optimizer {o!r}; choose from "
                     f"{', '.join(OPTIMIZERS)}")
    if a.steps < 1 or a.warmup < 0:
        ap.error("argument --steps must be >= 1 and --warmup >= 0")
    if a.backend == "nccl" and a.device != "cuda":
        ap.error("argument --backend nccl needs --device cuda")
    a.model = a.model or ("gpt2s" if a.device == "cuda" else "tiny")
    m = dict(MODELS[a.model])
    for k in ("d_model", "heads", "layers", "seq"):
        if getattr(a, k) is not None:
            m[k] = getattr(a, k)
    if m["d_model"] % m["heads"]:
        ap.error("--d-model must be a multiple of --heads")
    a.mcfg = m
    a.batch = a.batch or (8 if a.device == "cuda" else 2)
    a.lr = a.lr or (6e-4 if a.model == "gpt2s" else 2e-3)
    a.lamb_lr = a.lamb_lr or 2 * a.lr
    a.amp = a.amp or ("bf16" if a.device == "cuda" else "none")
    a.name = a.name or f"train_{a.device}"
    return a


def _meta(a: argparse.Namespace, argv: Sequence[str]) -> Dict[str, Any]:
    import platform

    import torch

    import compcomm

    gpu = None
    if a.device == "cuda" and torch.cuda.is_available():
        gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    nd = []
    if a.fused is not None:
        nd.append(f"fused={a.fused}")
    if a.reduce_bucket_size is not None:
        nd.append(f"reduce_bucket_size={int(a.reduce_bucket_size)}")
    if a.overlap_groups is not None:
        nd.append(f"overlap MAX_GROUPS={a.overlap_groups}")
    if a.bias_correction:
        nd.append("bias_correction=True")
    if a.local_step_scaler:
        nd.append(f"ZeroOneAdam local_step_scaler={a.local_step_scaler}")
    if a.local_step_clipper:
        nd.append(f"ZeroOneAdam local_step_clipper={a.local_step_clipper}")
    if a.backend != "torch":
        nd.append(f"comm_backend_name='{a.backend}'")
    if a.ag_options:
        nd.append(f"all-gather {a.ag_options}")
    if a.fsdp_bf16:
        nd.append("FSDP2 bf16 parameters and reduction")
    if a.fsdp_unbatched:
        nd.append("FSDP2 1-bit segments unbatched")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "cpus": os.cpu_count(), "gpu": gpu,
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        "compcomm": compcomm.__version__, "torch": torch.__version__,
        "python": platform.python_version(),
        "command": "compcomm-bench train " + " ".join(argv),
        "device": a.device, "model": a.model, **a.mcfg, "batch": a.batch, "lr": a.lr,
        "lamb_lr": a.lamb_lr, "lr_schedule": a.lr_schedule, "lr_warmup": a.lr_warmup,
        "warmup": a.warmup, "amp": a.amp, "backend": a.backend, "seed": a.seed,
        "non_default": ("; non-default: " + ", ".join(nd)) if nd else "",
        "params": param_count(**a.mcfg), "target_val_loss": a.target_val_loss,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``compcomm-bench train``; see the module docstring."""
    from . import netns, runner

    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if any(PROFILES[p].netns for p in a.profiles):
        try:
            netns.check_privileges()
        except netns.NetnsError as e:
            print(f"compcomm-bench train: {e}", file=sys.stderr)
            return 2
    gpus = 0
    if a.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if gpus == 0:
            print("compcomm-bench train: --device cuda but no CUDA device", file=sys.stderr)
            return 2
    meta = _meta(a, argv)
    doc: Dict[str, Any] = {"meta": meta, "rows": []}
    status = 0
    t_start = time.time()
    for prof in a.profiles:
        for w in a.worlds:
            cfg = dict(device=a.device, **a.mcfg, batch=a.batch, optimizers=a.opt_list,
                       steps=a.steps, baseline_steps=a.baseline_steps, warmup=a.warmup,
                       max_seconds=a.max_seconds,
                       eval_every=0 if a.timing_only else a.eval_every,
                       val_batches=a.val_batches, compute_steps=a.compute_steps, lr=a.lr,
                       lamb_lr=a.lamb_lr, lr_schedule=a.lr_schedule, lr_warmup=a.lr_warmup,
                       amp=a.amp, backend=a.backend, fused=a.fused,
                       reduce_bucket_size=a.reduce_bucket_size,
                       overlap_groups=a.overlap_groups,
                       bias_correction=a.bias_correction,
                       local_step_scaler=a.local_step_scaler,
                       local_step_clipper=a.local_step_clipper, data_bytes=a.data_bytes,
                       seed=a.seed,
                       ag_options=a.ag_options, fsdp_bf16=a.fsdp_bf16,
                       fsdp_unbatched=a.fsdp_unbatched,
                       threads=a.threads, progress=a.progress,
                       collective_timeout=max(60.0, min(a.timeout, 900.0)))
            compute: Dict[str, Any] = {}
            done: List[str] = []

            def on_line(line: str, prof: str = prof, w: int = w) -> None:
                if line.startswith("COMPUTE "):
                    compute.update(json.loads(line[8:]))
                    meta["params"] = compute.get("params", meta["params"])
                elif line.startswith("RESULT "):
                    row = json.loads(line[7:])
                    row.update(profile=prof, world_size=w, batch=a.batch, seq=a.mcfg["seq"],
                               compute_s=compute.get("compute_s"),
                               compute_all_s=compute.get("compute_all"))
                    if row.get("step_s"):
                        row["summary"] = summarize(row)
                    doc["rows"].append(row)
                    done.append(row["optimizer"])
                    if row.get("error"):
                        print(f"[train] {prof} W={w} {row['optimizer']:>20}: FAILED after "
                              f"{row['steps_run']} steps: {row['error'][:300]}", flush=True)
                    if "summary" not in row:
                        write_outputs(doc, a.out, a.name)
                        return
                    s = row["summary"]
                    print(f"[train] {prof} W={w} {row['optimizer']:>20}: {s['main_phase']} step "
                          f"{s['step_s'] * 1e3:9.1f} ms, compute {row['compute_s'] * 1e3:8.1f} ms, "
                          f"{fmt_bytes(s['bytes_per_step'])}/step, val loss "
                          f"{row['final_val_loss']:.4f}" + _overlap_note(row), flush=True)
                    write_outputs(doc, a.out, a.name)  # partial results survive a later kill
                elif line.startswith("PROGRESS "):
                    print(line.rstrip(), flush=True)

            print(f"[train] {prof} W={w}: {', '.join(a.opt_list)} ({a.device}, {a.model})",
                  flush=True)
            with tempfile.TemporaryDirectory(prefix="cctrain-") as tmp:
                path = os.path.join(tmp, "config.json")
                with open(path, "w") as fh:
                    json.dump(cfg, fh)
                try:
                    runner.run_on_profile(prof, w, ["-m", "compcomm.bench.train", "--_rank", path],
                                          timeout=a.timeout, on_line=on_line, gpus=gpus,
                                          launcher="mpirun" if a.backend == "mpi" else "direct")
                except (runner.SweepError, netns.NetnsError) as e:
                    status = 1
                    msg = str(e)
                    print(f"[train] {prof} W={w} FAILED: {msg[-4000:]}", file=sys.stderr, flush=True)
                    for o in a.opt_list:
                        if o not in done:
                            doc["rows"].append({"profile": prof, "world_size": w, "optimizer": o,
                                                "error": msg.splitlines()[0] if msg else "failed"})
    meta["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    meta["wall_s"] = round(time.time() - t_start, 1)
    paths = write_outputs(doc, a.out, a.name)
    with open(paths["md"]) as fh:
        print(fh.read())
    print("wrote " + ", ".join(paths.values()))
    return status


def _overlap_note(row: Dict[str, Any]) -> str:
    """onebitadam_overlap's rank 0 counts: steps committed from the backward's exchanges."""
    ov = row.get("overlap")
    if not ov:
        return ""
    return (f", overlap: {ov['steps_overlapped']} steps, {ov['groups_from_backward']} groups"
            + ("" if ov["enabled"] else " (switched itself off)"))


def _rank_entry(path: str) -> None:
    with open(path) as fh:
        cfg = json.load(fh)
    rc = rank_main(cfg)
    # skip interpreter teardown (see compcomm.bench.worker): destroying process groups while a
    # peer still closes its sockets aborted ranks after all results were in
    os._exit(rc)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_rank":
        _rank_entry(sys.argv[2])
    sys.exit(main())
