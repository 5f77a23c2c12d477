"""One rank of ``compcomm-bench train`` (:mod:`compcomm.bench.train`): the model, its text, and
the training loop.

Each rank process runs :func:`rank_main` on the config the driver wrote: a compute reference
(forward + backward with no communication), then every optimizer in turn, printing ``COMPUTE`` and
``RESULT`` lines (JSON, rank 0 only) that the driver collects; ``PROGRESS`` lines with
``--progress``.

Profiling: with ``COMPCOMM_PROFILE_DIR`` set, rank 0 records each optimizer's last three steps
(forward, backward and the optimizer step, labelled ``optimizer.step``) with ``torch.profiler`` (CPU
and, on GPU, CUDA activity) and writes the operator tables, sorted by host and by device time, to
``<dir>/<optimizer>.txt`` (where a step's time goes, e.g. launches and copies per bucket). The
profiler slows the steps it records: use the counts, not the step times, of such a run.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Dict, List

from .train_setups import COMPRESSED, IDENTITY, make, phase

__all__ = ["MODELS", "build_model", "param_count", "load_text", "rank_main"]

MODELS: Dict[str, Dict[str, int]] = {
    "tiny": dict(d_model=256, heads=4, layers=10, seq=64),
    "gpt2s": dict(d_model=768, heads=12, layers=17, seq=256),
}


# ------------------------------------------------------------------------------------------------
# model and data
# ------------------------------------------------------------------------------------------------
def build_model(d_model: int, heads: int, layers: int, seq: int) -> Any:
    """compcomm-demo's GPT-style byte-level transformer with GPT-2's initialisation."""
    from ..demo import build_model as demo_model

    return demo_model(d_model, heads, layers, seq, scaled_init=True)


def param_count(d_model: int, layers: int, seq: int, **_: Any) -> int:
    """Parameters of :func:`build_model` (12 d^2 + 2 d per layer, embeddings, final norm)."""
    return layers * (12 * d_model * d_model + 2 * d_model) + (256 + seq + 1) * d_model


def load_text(nbytes: int) -> bytes:
    """The first ``nbytes`` of the standard library's ``*.py`` sources (as compcomm-demo), repeated
    if the library is smaller."""
    from ..demo import load_text as demo_text

    data = demo_text(nbytes)
    if not data:
        raise RuntimeError("no standard-library source found for the training text")
    while len(data) < nbytes:
        data += data[: nbytes - len(data)]
    return data


# ------------------------------------------------------------------------------------------------
# one rank
# ------------------------------------------------------------------------------------------------
def train_batches(seed: int, rank: int) -> Any:
    """The generator of a rank's training batch offsets: the same batches in every run of a seed
    (seed 0: the stream of the runs made before --seed existed). The model's initialisation is
    ``torch.manual_seed(seed)``; the validation batches do not depend on the seed."""
    import torch

    return torch.Generator().manual_seed(10_000 * (rank + 1) + 1_000_003 * seed)


def _sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def lr_factor(cfg: Dict[str, Any], t: int, steps: int) -> float:
    """The lr multiplier of step ``t`` (1-based) of ``steps``: 1 (constant), or a linear ramp over
    ``lr_warmup`` steps then a cosine decay to 0.1 at the last step."""
    if cfg.get("lr_schedule", "constant") == "constant":
        return 1.0
    ramp = cfg.get("lr_warmup", 0)
    if t <= ramp:
        return t / ramp
    done = (t - ramp) / max(1, steps - ramp)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * done))


def _start_profiler(dev: Any) -> Any:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    prof = profile(activities=acts)
    prof.__enter__()
    return prof


def _record(prof: Any, label: str) -> Any:
    import contextlib

    import torch

    return torch.profiler.record_function(label) if prof is not None else contextlib.nullcontext()


def _stop_profiler(prof: Any, dev: Any, path: str) -> None:
    prof.__exit__(None, None, None)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    events = prof.key_averages()
    with open(path, "w") as f:
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=70))
        if dev.type == "cuda":
            f.write("\n" + events.table(sort_by="self_device_time_total", row_limit=40,
                                         max_name_column_width=70))


def _train_one(name: str, cfg: Dict[str, Any], rank: int, world: int, dev: Any, new_model: Any,
               batch: Any, train: Any, loss_of: Any, evaluate: Any, barrier: Any,
               rec: Dict[str, List[Any]], evals: List[List[float]], out: Any) -> Dict[str, Any]:
    """Train optimizer ``name`` for its steps, appending to ``rec``/``evals`` as it goes (so a
    failure keeps the steps done); returns the row's other fields."""
    import torch
    import torch.distributed as dist

    model = new_model()
    objs = make(name, model, cfg, world, dev)
    module, opt, kind = objs["module"], objs["opt"], objs["kind"]
    nparams = sum(p.numel() for p in model.parameters())
    comm = getattr(opt, "comm", None)
    counted = objs.get("sent") or ((lambda: comm.bytes_sent) if comm is not None else None)
    reduce_sent = objs.get("reduce_sent")  # FSDP2: the gradient reduce-scatters alone
    if reduce_sent is not None:
        rec.setdefault("reduce_bytes", [])
    grad_bytes = nparams * (2 if name == "ddp_adamw_bf16hook" else 4)
    ddp_bytes = 2 * (world - 1) * grad_bytes // world if world > 1 else 0
    gen = train_batches(cfg.get("seed", 0), rank)
    seq, bsz = cfg["seq"], cfg["batch"]
    steps = cfg["steps"] if (name in COMPRESSED + IDENTITY or cfg["baseline_steps"] is None) \
        else cfg["baseline_steps"]
    base_lr = [g["lr"] for g in opt.param_groups]
    wall = 0.0
    began = time.monotonic()
    stopped_early = False
    profile_dir, prof = os.environ.get("COMPCOMM_PROFILE_DIR"), None
    try:
        for t in range(1, steps + 1):
            x, y = batch(train, torch.randint(0, train.numel() - seq - 1, (bsz,), generator=gen))
            rec["phase"].append(phase(name, opt, t, cfg["warmup"]))
            before = counted() if counted is not None else 0
            rbefore = reduce_sent() if reduce_sent is not None else 0
            barrier()
            _sync(dev)
            t0 = time.perf_counter()
            for g, lr in zip(opt.param_groups, base_lr):
                g["lr"] = lr * lr_factor(cfg, t, steps)
            opt.zero_grad(set_to_none=True)
            loss = loss_of(module, x, y)
            loss.backward()
            _sync(dev)
            t1 = time.perf_counter()
            if prof is None and profile_dir and rank == 0 and t == steps - 2:
                prof = _start_profiler(dev)
            with _record(prof, "optimizer.step"):
                opt.step()
            _sync(dev)
            t2 = time.perf_counter()
            sent = counted() - before if counted is not None else ddp_bytes
            if reduce_sent is not None:
                rec["reduce_bytes"].append(int(reduce_sent() - rbefore))
            rec["fwdbwd_s"].append(t1 - t0)
            rec["opt_s"].append(t2 - t1)
            rec["step_s"].append(t2 - t0)
            rec["bytes"].append(int(sent))
            lt = loss.detach().float().reshape(1)
            dist.all_reduce(lt)  # logging only, not counted
            rec["loss"].append(float(lt) / world)
            wall += t2 - t0
            # diverged: non-finite, or 3x the first step's loss (ZeRO then skips the non-finite
            # steps, which would time as fast steps that communicate nothing)
            diverged = not math.isfinite(rec["loss"][-1]) or rec["loss"][-1] > 3 * rec["loss"][0]
            if cfg["eval_every"] and (t % cfg["eval_every"] == 0 or t == steps or diverged):
                evals.append([t, evaluate(module), wall, float(sum(rec["bytes"]))])
                if objs.get("after_eval"):  # FSDP2 re-gather cache: a step's bytes its own
                    objs["after_eval"]()
            if rank == 0 and cfg.get("progress"):
                print(f"PROGRESS {name} step {t}/{steps} {rec['phase'][-1]} loss "
                      f"{rec['loss'][-1]:.4f} {t2 - t0:.3f} s {sent} B", file=out, flush=True)
            # every rank must agree to stop (a time budget per optimizer, or a divergence)
            over = torch.tensor([1.0 if (cfg["max_seconds"] and time.monotonic() - began >
                                         cfg["max_seconds"]) or diverged else 0.0], device=dev)
            dist.all_reduce(over, op=dist.ReduceOp.MAX)
            if float(over) > 0 and t < steps:
                stopped_early = True
                break
        if not evals or evals[-1][0] != len(rec["loss"]):
            evals.append([len(rec["loss"]), evaluate(module), wall, float(sum(rec["bytes"]))])
    finally:
        if prof is not None:
            _stop_profiler(prof, dev, os.path.join(profile_dir, name + ".txt"))
        if hasattr(opt, "close"):
            opt.close()
    ov = getattr(opt, "overlap", None)  # onebitadam_overlap: what the backward overlap did
    ov = ov if hasattr(ov, "steps_overlapped") else None  # (ZeroOptimizer.overlap is a flag)
    return {"steps_planned": steps, "stopped_early": stopped_early, "params": nparams,
            "ddp_ring_bytes": ddp_bytes if kind == "ddp" else None,
            # which communicator carried compcomm's optimizer ("torch(gloo)", "nccl", "mpi", ...)
            "comm_backend": comm.backend_name() if comm is not None else None,
            **({"overlap": {"steps_overlapped": ov.steps_overlapped, "enabled": ov.enabled,
                            "groups_from_backward": ov.groups_from_backward}}
               if ov is not None else {})}


def rank_main(cfg: Dict[str, Any]) -> int:
    """One rank's whole run on ``cfg`` (the driver's config); returns its exit status."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import compcomm

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=cfg["collective_timeout"])
    if cfg["device"] == "cuda":
        ngpu = torch.cuda.device_count()
        if ngpu == 0:
            raise RuntimeError("train: --device cuda but no CUDA device is visible")
        dev = torch.device("cuda", rank % ngpu)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", timeout=timeout, device_id=dev)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(cfg.get("threads", 1))
        dist.init_process_group("gloo", timeout=timeout)
    if cfg.get("backend") == "nccl":  # the optimizers' comm_backend_name (train_setups)
        compcomm.init("nccl")
    elif cfg.get("backend") == "mpi":
        compcomm.init("mpi", cuda_aware=False)  # host-staged, as the help says
    amp = cfg["amp"] == "bf16"
    out = sys.stdout

    def emit(tag: str, obj: Any) -> None:
        if rank == 0:
            print(f"{tag} {json.dumps(obj)}", file=out, flush=True)

    def barrier() -> None:
        if dev.type == "cuda":
            dist.barrier(device_ids=[dev.index])
        else:
            dist.barrier()

    mcfg = {k: cfg[k] for k in ("d_model", "heads", "layers", "seq")}
    seq, bsz = cfg["seq"], cfg["batch"]
    data = torch.frombuffer(bytearray(load_text(cfg["data_bytes"])), dtype=torch.uint8).long()
    split = int(0.9 * data.numel())
    train, val = data[:split], data[split:]
    gval = torch.Generator().manual_seed(1234)
    nval = max(world, cfg["val_batches"])
    vstarts = torch.randint(0, val.numel() - seq - 1, (nval, bsz), generator=gval)[rank::world]

    def batch(src: Any, starts: Any) -> Any:
        idx = starts[:, None] + torch.arange(seq + 1)[None, :]
        chunk = src[idx].to(dev, non_blocking=True)
        return chunk[:, :-1], chunk[:, 1:]

    def loss_of(module: Any, x: Any, y: Any) -> Any:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            logits = module(x)
        return F.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))

    def evaluate(module: Any) -> float:
        with torch.no_grad():
            tot = torch.zeros(2, dtype=torch.float64, device=dev)
            for s in vstarts:
                x, y = batch(val, s)
                tot[0] += float(loss_of(module, x, y))
                tot[1] += 1
            dist.all_reduce(tot)
        return float(tot[0] / tot[1])

    def new_model() -> Any:
        torch.manual_seed(cfg.get("seed", 0))
        return build_model(**mcfg).to(dev)

    # Compute reference: forward + backward, no communication, all ranks at once.
    model = new_model()
    gen = torch.Generator().manual_seed(99 + rank)
    ctimes: List[float] = []
    for i in range(cfg["compute_steps"] + 1):
        x, y = batch(train, torch.randint(0, train.numel() - seq - 1, (bsz,), generator=gen))
        barrier()
        _sync(dev)
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss_of(model, x, y).backward()
        _sync(dev)
        if i:  # the first pass allocates
            ctimes.append(time.perf_counter() - t0)
    ct = torch.tensor(ctimes or [float("nan")], dtype=torch.float64, device=dev)
    dist.all_reduce(ct, op=dist.ReduceOp.MAX)
    nparams = sum(p.numel() for p in model.parameters())
    emit("COMPUTE", {"compute_s": statistics.median(ct.tolist()), "compute_all": ct.tolist(),
                     "params": nparams})
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    for name in cfg["optimizers"]:
        rec: Dict[str, List[Any]] = {k: [] for k in
                                     ("loss", "phase", "fwdbwd_s", "opt_s", "step_s", "bytes")}
        evals: List[List[float]] = []
        try:
            info = _train_one(name, cfg, rank, world, dev, new_model, batch, train, loss_of,
                              evaluate, barrier, rec, evals, out)
            error = None
        except Exception as e:  # e.g. NonFiniteError after a divergence: raised on every rank
            info, error = {"steps_planned": None, "params": nparams}, f"{type(e).__name__}: {e}"
            print(f"train: {name} failed on rank {rank}: {error}", file=sys.stderr, flush=True)
        n = min(len(v) for v in rec.values())  # steps completed (a failure may cut one short)
        for v in rec.values():
            del v[n:]
        # the slowest rank's time of every step
        if n:
            tt = torch.tensor([rec["fwdbwd_s"], rec["opt_s"], rec["step_s"]], dtype=torch.float64,
                              device=dev)
            dist.all_reduce(tt, op=dist.ReduceOp.MAX)
            rec["fwdbwd_s"], rec["opt_s"], rec["step_s"] = (r for r in tt.tolist())
        final_val = evals[-1][1] if evals else float("nan")
        emit("RESULT", {"optimizer": name, "steps_run": n, "error": error,
                        "stopped_early": bool(error) or info.get("stopped_early", False),
                        "final_val_loss": final_val, "val_curve": evals, **info, **rec})
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        barrier()
    barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    return 0
